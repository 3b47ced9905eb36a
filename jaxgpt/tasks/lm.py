"""Language modelling: next-token cross-entropy on a prepared token dataset.

The batch of step i is `batch_for_step(seed, i)` (random windows of block_size + 1 tokens), so resuming
needs no iterator state; evaluation batches are fixed per split, so losses compare across a run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import jax
import numpy as np
import optax
from jax.experimental import multihost_utils

from jaxgpt import weights
from jaxgpt.data import Dataset, batch_for_step, check_shapes, eval_batches, load_dataset
from jaxgpt.datasets import prepare_builtin
from jaxgpt.errors import UserError
from jaxgpt.model import GPT, dummy_tokens
from jaxgpt.train_config import DataConfig, TrainConfig


def open_dataset(data: DataConfig) -> Dataset:
    """Load the prepared dataset, preparing a built-in one on first use."""
    data_dir = Path(data.dir)
    bpe_file = data.bpe_file or None

    def prepare_if_missing() -> None:
        if not (data_dir / "meta.json").exists() and data.name:
            if jax.process_index() == 0:
                print(f"preparing dataset {data.name} in {data_dir} ...", flush=True)
            prepare_builtin(data.name, data_dir, bpe_file=bpe_file)

    if jax.process_count() == 1:
        prepare_if_missing()
    else:  # process 0 first: on a shared filesystem the others then find it ready instead of racing it
        if jax.process_index() == 0:
            prepare_if_missing()
        multihost_utils.sync_global_devices("jaxgpt-dataset-ready")
        prepare_if_missing()  # host-local disks: every host needs its own copy
    return load_dataset(data_dir, bpe_file=bpe_file)


def cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits_BTV, targets_BT).mean()


class LanguageModelling:
    """A GPT on a token dataset. `dataset=None` gives the model and objective only (ahead-of-time compiles)."""

    batch_ndims: ClassVar[dict[str, int]] = {"x": 2, "y": 2}

    def __init__(self, cfg: TrainConfig, dataset: Dataset | None) -> None:
        model_cfg = cfg.model
        if dataset is not None:
            vocab = dataset.meta["vocab_size"]
            if cfg.vocab_from_data:
                model_cfg = model_cfg.replace(vocab_size=vocab)
            elif model_cfg.vocab_size < vocab:
                raise UserError(f"config.model.vocab_size={model_cfg.vocab_size} is smaller than the dataset's "
                                f"vocabulary ({vocab}): raise it or leave it unset")
            for split in ("train", "val"):  # a block size the data cannot fill fails before anything is written
                check_shapes(len(getattr(dataset, split)), 1, model_cfg.block_size, split)
        self.cfg, self.dataset, self.model_cfg = cfg, dataset, model_cfg
        self.model = GPT(model_cfg)
        self.tokenizer_meta = dataset.meta["tokenizer"] if dataset is not None else {}
        self.meta = {"dataset": dataset.meta if dataset is not None else {}}
        self.tokens_per_row = model_cfg.block_size
        self.eval_rows_per_batch = cfg.batch_size // cfg.grad_accum
        self._dropout = any(getattr(model_cfg, f"{name}_dropout") > 0 for name in ("embd", "attn", "resid", "ff"))

    def example_input(self) -> jax.Array:
        return dummy_tokens(self.model_cfg)

    def loss(self, params: Any, batch: dict[str, jax.Array], key: jax.Array) -> tuple[jax.Array, dict]:
        logits = self.model.apply({"params": params}, batch["x"], deterministic=not self._dropout,
                                  rngs={"dropout": key} if self._dropout else None)
        return cross_entropy(logits, batch["y"]), {}

    def evaluate(self, params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        return cross_entropy(self.model.apply({"params": params}, batch["x"]), batch["y"])

    def pretrained(self) -> Any | None:
        if not self.cfg.init_from:
            return None
        return jax.device_get(weights.load_for(self.cfg.init_from, self.model_cfg).params)

    def check_resume(self, saved_meta: dict[str, Any], workdir: str) -> None:
        saved, now = saved_meta["model"], self.model_cfg.to_dict()
        if saved != now:
            diff = sorted(k for k in saved if saved[k] != now.get(k))
            raise UserError(f"the checkpoint in {workdir} was trained with different model settings {diff}: "
                            "use the same model config or a new --config.workdir")

    def train_rows(self, step: int, process_index: int, process_count: int) -> dict[str, np.ndarray]:
        x, y = batch_for_step(self.dataset.train, seed=self.cfg.seed, step=step, batch_size=self.cfg.batch_size,
                              block_size=self.model_cfg.block_size, process_index=process_index,
                              process_count=process_count)
        return {"x": x, "y": y}

    def eval_rows(self, process_index: int, process_count: int) -> dict[str, list[dict[str, np.ndarray]]]:
        return {split: [{"x": x, "y": y} for x, y in eval_batches(
            getattr(self.dataset, split), batch_size=self.eval_rows_per_batch, block_size=self.model_cfg.block_size,
            n_batches=self.cfg.eval_batches, seed=self.cfg.seed, split=split, process_index=process_index,
            process_count=process_count)] for split in ("train", "val")}

    def summarize(self, outputs: dict[str, list[Any]]) -> dict[str, Any]:
        return {f"{split}_loss": float(np.mean(losses)) for split, losses in outputs.items()}

    def describe(self) -> str:
        return ""

    def eval_line(self, step: int, metrics: dict[str, Any]) -> str:
        return f"step {step}: train loss {metrics['train_loss']:.4f}, val loss {metrics['val_loss']:.4f}"

    def final_line(self, metrics: dict[str, Any]) -> str | None:
        return None

