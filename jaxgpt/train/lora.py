"""LoRA runs: any language-model task (lm, chat) trained as low-rank adapters beside its frozen base.

`adapt(task, cfg)` wraps the task `jaxgpt.tasks.build` made. The wrapper's parameters are the adapters alone
(`jaxgpt.model.lora`), so the one loop, the one train step and the one checkpointer need no LoRA case: only
adapters get gradients, optimizer moments and checkpoint space, because they are all the state holds. The base is
the step's *frozen* argument (`Program.frozen`): placed once on the mesh by the model's own sharding rules, passed to
every step and evaluation, never differentiated and never saved (a closed-over array would be baked into the
compiled program as a constant). The loss calls the task's own loss on the base with the adapters beside its
kernels (`lora.overlay`: applied unmerged in the projections, no kernel copied, LoRA dropout there), so every
objective and evaluation of the task holds unchanged; benchmarks and export read merged weights (`lora.merge`).

The run records its base (`meta["lora"]`: init_from and a content hash of the base's parameters) and refuses to
resume onto another; `jaxgpt.io.weights` loads a LoRA run as its merged weights for sampling, serving and evals.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax

from jaxgpt.errors import UserError
from jaxgpt.io.peft import read_peft
from jaxgpt.model import lora
from jaxgpt.train.config import TrainConfig
from jaxgpt.train.task import Task

DROPOUT_STREAM = 0x10DA  # LoRA dropout's keys: the step key folded with this, apart from the model's own dropout


class Adapted:
    """A task whose trained parameters are LoRA adapters on the task's pretrained weights (the frozen base)."""

    def __init__(self, inner: Task, cfg: TrainConfig) -> None:
        self.inner, self.cfg = inner, cfg
        self.model_cfg, self.tokenizer_meta = inner.model_cfg, inner.tokenizer_meta
        self.batch_ndims, self.tokens_per_row = inner.batch_ndims, inner.tokens_per_row
        self.eval_rows_per_batch = inner.eval_rows_per_batch
        self.example_inputs, self.train_rows, self.eval_rows = inner.example_inputs, inner.train_rows, inner.eval_rows
        self.summarize, self.eval_line, self.final_line = inner.summarize, inner.eval_line, inner.final_line
        c = cfg.lora
        boxed = jax.eval_shape(inner.model.init, jax.random.key(0), *inner.example_inputs())["params"]
        self.base_axes = nn.get_partition_spec(boxed)
        self.sites = lora.sites(boxed, c.target_names, c.rank)
        self.peft = read_peft(c.init_from.removeprefix("peft:"), self.model_cfg, c, self.sites) if c.init_from \
            else None
        self.base = jax.device_get(inner.pretrained())
        self.scale = lora.scale(c.alpha, c.rank, c.rslora)
        self.model = lora.Adapters(self.sites)
        self.meta = {**inner.meta, "lora": {"rank": c.rank, "alpha": c.alpha, "rslora": c.rslora, "dropout": c.dropout,
                                            "targets": sorted({s.target for s in self.sites}),
                                            "base": {"source": cfg.init_from, "sha256": lora.digest(self.base)}}}
        if hasattr(inner, "run_files"):
            self.run_files = inner.run_files
        if hasattr(inner, "benchmarks"):
            self.benchmarks = lambda adapters, rows: inner.benchmarks(self.merged(adapters), rows)
        self._placed: Any = None

    def frozen(self, shardings: Any) -> tuple[Any]:
        """The base on the devices, placed by `shardings` (the model's parameter shardings): `Program.frozen`."""
        if self._placed is None:
            self._placed = jax.device_put(self.base, shardings)
        return (self._placed,)

    def merged(self, adapters: Any) -> Any:
        """The base with the adapters merged (outside the step: benchmarks)."""
        return lora.merge(self._placed, adapters, self.scale)

    def loss(self, adapters: Any, batch: dict[str, jax.Array], key: jax.Array, base: Any) -> tuple[jax.Array, dict]:
        params = lora.overlay(jax.lax.stop_gradient(base), adapters, self.scale, self.cfg.lora.dropout,
                              jax.random.fold_in(key, DROPOUT_STREAM))
        return self.inner.loss(params, batch, key)

    def evaluate(self, adapters: Any, batch: dict[str, jax.Array], base: Any) -> Any:
        return self.inner.evaluate(lora.overlay(base, adapters, self.scale), batch)

    def pretrained(self) -> Any | None:
        """The adapters of config.lora.init_from (a PEFT directory), or None: initialized (B = 0)."""
        return self.peft

    def check_resume(self, saved_meta: dict[str, Any], workdir: str) -> None:
        self.inner.check_resume(saved_meta, workdir)
        saved = saved_meta.get("lora")
        if saved is None or saved["base"]["sha256"] != self.meta["lora"]["base"]["sha256"]:
            what = "a run without LoRA" if saved is None else f"adapters of another base ({saved['base']['source']})"
            raise UserError(f"{workdir} holds {what}, not LoRA adapters of {self.cfg.init_from} as configured: use "
                            "the same init_from and config.lora, or a new --config.workdir")

    def describe(self) -> str:
        n = sum(x.size for x in jax.tree.leaves(self.base))
        return "\n".join(line for line in (self.inner.describe(), (
            f"LoRA rank {self.cfg.lora.rank} (scale {self.scale:g}) on {', '.join(self.meta['lora']['targets'])}: "
            f"{len(self.sites)} adapters beside {n:,} frozen parameters of {self.cfg.init_from}")) if line)


def adapt(task: Task, cfg: TrainConfig) -> Task:
    """`task` as configured: wrapped in `Adapted` when config.lora.rank is set, else unchanged."""
    return Adapted(task, cfg) if cfg.lora.rank else task
