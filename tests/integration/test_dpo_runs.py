"""DPO runs on the training loop: the reward accuracy rises and the run is a chat run, the reference computed once
and read back on resume, gradient accumulation, a live reference, SIGKILL and resume."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers.chat import ALPHABET
from helpers.models import save_random_lm

from jaxgpt.data.tokenizer import CharTokenizer
from jaxgpt.model.config import ModelConfig
from jaxgpt.train.config import base_config

TRL_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
               "logps/rejected")


@pytest.fixture(scope="module")
def base_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    workdir = tmp_path_factory.mktemp("base")
    save_random_lm(workdir, ModelConfig(vocab_size=len(ALPHABET), block_size=64, n_layer=1, n_head=2, n_embd=32),
                   CharTokenizer(ALPHABET))
    return workdir


def toy_pairs(path: Path, n: int = 200) -> Path:
    """A preference a small model learns in a few steps, whatever the prompt: a reply of 'a's over one of 'b's
    (text and conversation forms alternating)."""
    rng = np.random.default_rng(0)
    lines = []
    for i in range(n):
        prompt = f"Say {''.join(rng.choice(list('xyzw'), 5))}"
        k = int(rng.integers(1, 4))
        if i % 2:
            lines.append({"prompt": prompt, "chosen": "a" * k, "rejected": "b" * k})
        else:
            lines.append({"prompt": [{"role": "user", "content": prompt}],
                          "chosen": [{"role": "assistant", "content": "a" * k}],
                          "rejected": [{"role": "assistant", "content": "b" * k}]})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def dpo_config(workdir: Path, base: Path, **overrides: object):
    """The toy pairs beside the work directory (or the built-in ones: dpo.data=builtin), 16 pairs a step."""
    c = base_config()
    c.task, c.workdir, c.init_from = "dpo", str(workdir), f"workdir:{base}"
    c.dpo.data, c.dpo.val_fraction = str(toy_pairs(workdir.parent / "pairs.jsonl")), 0.15
    c.dpo.examples, c.dpo.datasets = 240, "arithmetic,reverse"
    c.batch_size, c.max_steps, c.eval_interval, c.log_interval, c.ckpt_interval, c.eval_batches = 16, 30, 15, 1, 15, 4
    c.dpo.beta, c.optim.lr, c.optim.warmup_steps, c.optim.weight_decay = 0.5, 3e-2, 1, 0.0
    c.compilation_cache_dir = ""
    c.update_from_flattened_dict(overrides)
    return c


def _records(workdir: Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_reward_accuracy_rises_from_ln_2_and_the_run_is_a_chat_run(tmp_path: Path, base_run: Path) -> None:
    from helpers import train_run

    from jaxgpt.generate.chat import ChatModel
    from jaxgpt.io import weights

    workdir = tmp_path / "run"
    result = train_run(dpo_config(workdir, base_run))
    steps = [r for r in _records(workdir) if "train_loss" in r and "val_loss" not in r]
    first = steps[0]
    assert first["step"] == 1 and abs(first["train_loss"] - 0.6931472) < 1e-5, first  # policy = reference
    assert abs(first["train_rewards/margins"]) < 1e-5
    assert all(f"train_{m}" in first for m in TRL_METRICS)
    assert steps[-1]["train_loss"] < 0.6 and result["val_rewards/accuracies"] > 0.8, result
    assert result["val_loss"] < 0.69 and result["val_rewards/margins"] > 0
    assert (workdir / "reference_logps.npz").exists() and (workdir / "chat_template.jinja").exists()
    loaded = weights.load(f"workdir:{workdir}")  # sample.py --chat and jaxgpt serve read a run through these
    chat = ChatModel.from_run(loaded.params, loaded.model, loaded.tokenizer(), loaded.meta, None)
    assert len(chat.replies([("q", [{"role": "user", "content": "What is 1 + 1?"}])], max_new_tokens=3, seed=0,
                            temperature=0.0, top_p=1.0, slots=1)) == 1
