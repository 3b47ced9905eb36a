"""LoRA on the preference and RL tasks (`jaxgpt.train.lora` wrapping dpo and rl): the adapters alone train, DPO's
reward accuracy rises as the full run's test asks, and rl samples from the merged weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import logged_records, train_run
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
    rows = logged_records(workdir)
    first = next(r for r in rows if "train_loss" in r)
    assert abs(first["train_loss"] - 0.6931472) < 1e-5  # fresh adapters: the policy is the reference (the base)
    assert result["val_rewards/accuracies"] > 0.8 and result["val_loss"] < 0.69, result
    only_adapters_trained(workdir)


def test_rl_with_lora_learns_from_rollouts_of_the_merged_weights(tmp_path: Path, base_run: Path) -> None:
    """Rollouts and held-out sampling read the base with the adapters and the parameters trained beside them merged
    (`use_weights`): the sampled reward rises as full RL's does, and the greedy held-out answers turn to the
    rewarded 'a'. The bandit's answer is a row of the token table, which the tied head reads; in this 4,608-parameter
    model the blocks' adapters alone do not reach it (their sampled reward stayed at the base's ~1/64 over 24 steps
    at every rate from 3e-3 to 1e-1), so the table trains in full beside them (PEFT's modules_to_save)."""
    (tmp_path / "toy.py").write_text(A_REWARD)
    workdir = tmp_path / "rl"
    result = train_run(rl_config(workdir, base_run, f"{tmp_path / 'toy.py'}:is_a", batch_size=64,
                                 **{"rl.num_generations": 8, "rl.slots": 64, "lora.rank": 8, "lora.alpha": 16.0,
                                    "lora.modules_to_save": "wte"}))
    rows = logged_records(workdir)
    rewards = [r["train_reward"] for r in rows if "train_reward" in r]
    assert rewards[0] < 0.2 and rewards[-1] > 0.8, rewards
    assert result["val_pass_at_1"] == 1.0
    saved = final_params(workdir)
    assert {path[-1] for path in saved} == {"lora_a", "lora_b", "embedding"}, sorted(saved)
    assert all(np.abs(v).max() > 0 for path, v in saved.items() if path[-1] == "lora_b")
