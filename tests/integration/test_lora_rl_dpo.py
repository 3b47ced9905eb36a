"""LoRA on the preference and RL tasks (`jaxgpt.train.lora` wrapping dpo and rl): the adapters alone train, DPO's
reward accuracy rises as the full run's test asks, and rl samples from the merged weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import logged_eval, train_run
from helpers.chat import save_char_base
from helpers.runs import final_params
from test_dpo_runs import dpo_config
from test_rl_runs import A_REWARD, rl_config


@pytest.fixture(scope="module")
def base_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_char_base(tmp_path_factory.mktemp("base"))


def only_adapters_trained(workdir: Path) -> None:
    saved = final_params(workdir)
    assert saved and all(path[-1] in ("lora_a", "lora_b") for path in saved)
    assert all(np.abs(v).max() > 0 for path, v in saved.items() if path[-1] == "lora_b")


def test_dpo_with_lora_raises_the_reward_accuracy(tmp_path: Path, base_run: Path) -> None:
    workdir = tmp_path / "dpo"
    result = train_run(dpo_config(workdir, base_run, **{"lora.rank": 8, "lora.alpha": 16.0, "optim.lr": 1e-1}))
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in rows if "train_loss" in r)
    assert abs(first["train_loss"] - 0.6931472) < 1e-5  # fresh adapters: the policy is the reference (the base)
    assert result["val_rewards/accuracies"] > 0.8 and result["val_loss"] < 0.69, result
    only_adapters_trained(workdir)


def test_rl_with_lora_learns_from_rollouts_of_the_merged_weights(tmp_path: Path, base_run: Path) -> None:
    """Rollouts and held-out sampling read the base with the adapters merged (`use_weights`): the greedy held-out
    answers turn to the rewarded 'a' (adapters start at B = 0, so the sampled reward rises later than full RL's)."""
    (tmp_path / "toy.py").write_text(A_REWARD)
    workdir = tmp_path / "rl"
    result = train_run(rl_config(workdir, base_run, f"{tmp_path / 'toy.py'}:is_a", batch_size=64,
                                 **{"rl.num_generations": 8, "rl.slots": 64, "lora.rank": 8, "lora.alpha": 16.0,
                                    "optim.lr": 1e-1}))
    passes = [v for _, v in logged_eval(workdir, "val_pass_at_1")]
    assert passes[0] < 1.0 and passes[-1] == 1.0 and result["val_pass_at_1"] == 1.0, passes
    only_adapters_trained(workdir)
