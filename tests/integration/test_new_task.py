"""A task written outside jaxgpt (the `Task` protocol of jaxgpt/train/task.py) trains and resumes on the one loop
unchanged. Moved from tests/unit/commands/test_commands.py: it trains 200 steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax


class CopyTask:
    """A task the loop has never heard of: a GPT learns to repeat the previous token.

    Data come from a rule, not a dataset; everything else (state, steps, evaluation, checkpoints) is the loop's.
    """

    batch_ndims = {"x": 2, "y": 2}  # noqa: RUF012

    def __init__(self, cfg: Any) -> None:
        from jaxgpt.model.gpt import GPT

        self.cfg, self.model_cfg = cfg, cfg.model.replace(vocab_size=16)
        self.model = GPT(self.model_cfg)
        self.tokenizer_meta, self.meta = {}, {"task": "copy"}
        self.tokens_per_row, self.eval_rows_per_batch = self.model_cfg.block_size, cfg.batch_size

    def example_inputs(self) -> tuple[jax.Array]:
        return (jnp.zeros((1, 8), jnp.int32),)

    def _rows(self, seed: list[int], n: int) -> dict[str, np.ndarray]:
        x = np.random.default_rng(seed).integers(0, 16, (n, self.model_cfg.block_size), dtype=np.int32)
        return {"x": x, "y": np.roll(x, 1, axis=1)}

    def loss(self, params: Any, batch: dict, key: jax.Array) -> tuple[jax.Array, dict]:
        logits = self.model.apply({"params": params}, batch["x"])[:, 1:]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"][:, 1:]).mean(), {}

    def evaluate(self, params: Any, batch: dict) -> jax.Array:
        return self.loss(params, batch, jax.random.key(0))[0]

    def pretrained(self) -> None:
        return None

    def check_resume(self, saved_meta: dict, workdir: str) -> None:
        assert saved_meta["task"] == "copy"

    def train_rows(self, step: int, process_index: int, process_count: int) -> dict[str, np.ndarray]:
        rows = self._rows([self.cfg.seed, step], self.cfg.batch_size)
        n = self.cfg.batch_size // process_count
        return {k: v[process_index * n:(process_index + 1) * n] for k, v in rows.items()}

    def eval_rows(self, process_index: int, process_count: int) -> dict[str, list[dict[str, np.ndarray]]]:
        return {"val": [self._rows([self.cfg.seed, 10**6], self.cfg.batch_size)]}

    def summarize(self, outputs: dict[str, list[Any]]) -> dict[str, Any]:
        return {"val_loss": float(np.mean(outputs["val"]))}

    def describe(self) -> str:
        return "repeat the previous token"

    def eval_line(self, step: int, metrics: dict[str, Any]) -> str:
        return f"step {step}: copy loss {metrics['val_loss']:.3f}"

    def final_line(self, metrics: dict[str, Any]) -> str | None:
        return None


def test_a_new_task_trains_on_the_loop_unchanged(tmp_path: Path) -> None:
    from helpers import load_tiny

    from jaxgpt.train.config import from_config_dict
    from jaxgpt.train.loop import train

    c = load_tiny(workdir=str(tmp_path / "copy"), max_steps=200, eval_interval=100, ckpt_interval=100)
    c.model.vocab_size, c.optim.lr, c.optim.min_lr = 16, 1e-2, 1e-3
    cfg = from_config_dict(c)
    first = train(cfg, CopyTask)
    assert first["val_loss"] < 0.1, first["val_loss"]  # chance is log(16) = 2.77: it learned the rule
    again = train(cfg, CopyTask)  # resumes at the end: its checkpoint and meta are the task's
    assert again["steps"] == 0
