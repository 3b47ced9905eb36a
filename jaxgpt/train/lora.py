"""LoRA runs: any language-model task (lm, chat, rl, dpo) trained as low-rank adapters beside its frozen base.

`adapt(task, cfg)` wraps the task `jaxgpt.tasks.build` made. The wrapper's parameters are the adapters alone
(`jaxgpt.model.lora`), so the one loop, the one train step and the one checkpointer need no LoRA case: only
adapters get gradients, optimizer moments and checkpoint space, because they are all the state holds. The base is
the step's *frozen* argument (`Program.frozen`): placed once on the mesh by the model's own sharding rules, passed to
every step and evaluation, never differentiated and never saved (a closed-over array would be baked into the
compiled program as a constant). The loss calls the task's own loss on the base with the adapters beside its
kernels (`lora.overlay`: applied unmerged in the projections, no kernel copied, LoRA dropout there), so every
objective and evaluation of the task holds unchanged; benchmarks and export read merged weights (`lora.merge`).

rl samples its rollouts from the merged weights (`use_weights`); rl's and dpo's reference model is the base (the
task's own `pretrained`), which is where a run with fresh adapters starts.

The run records its base (`meta["lora"]`: init_from and a content hash of the base's parameters) and refuses to
resume onto another; `jaxgpt.io.weights` loads a LoRA run as its merged weights for sampling, serving and evals.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax

from jaxgpt.data.streams import LORA_DROPOUT_STREAM
from jaxgpt.errors import UserError
from jaxgpt.io.peft import read_peft
from jaxgpt.model import lora, quant
from jaxgpt.train.config import TrainConfig
from jaxgpt.train.task import Task


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
        self.saved = lora.saved_params(boxed, c.save_patterns, self.sites)
        if c.quantize and (clash := sorted({path for path, _ in quant.kernel_paths(boxed)} & set(self.saved))):
            raise UserError(f"config.lora.modules_to_save trains {'/'.join(clash[0])} in full, which "
                            f"config.lora.quantize={c.quantize} quantizes: drop it from modules_to_save or quantize")
        self.peft = read_peft(c.init_from.removeprefix("peft:"), self.model_cfg, c, self.sites) if c.init_from \
            else None
        self.base = jax.device_get(inner.pretrained())
        digest = lora.digest(self.base)  # of the float weights, so a quantized run and a float one share a base
        self._n_frozen = sum(x.size for x in jax.tree.leaves(self.base))
        self._abstract = boxed
        if c.quantize:  # QLoRA: the step receives (and the devices hold) the quantized base
            self.base, self.base_axes = quant.quantize_base(self.base, boxed, c.quantize, c.quantize_group)
        self.scale = lora.scale(c.alpha, c.rank, c.rslora)
        self.model = lora.Adapters(self.sites, self.saved)
        self.meta = {**inner.meta, "lora": {"rank": c.rank, "alpha": c.alpha, "rslora": c.rslora, "dropout": c.dropout,
                                            "targets": sorted({s.target for s in self.sites}),
                                            "quantize": c.quantize,
                                            "modules_to_save": sorted("/".join(p) for p in self.saved),
                                            "base": {"source": cfg.init_from, "sha256": digest}}}
        if hasattr(inner, "run_files"):
            self.run_files = inner.run_files
        if hasattr(inner, "benchmarks"):
            self.benchmarks = lambda adapters, rows: inner.benchmarks(self.merged(adapters), rows)
        if hasattr(inner, "use_weights"):  # rl samples its rollouts from the merged weights
            self.use_weights = lambda adapters: inner.use_weights(self.merged(adapters))
        self._placed: Any = None

    def frozen(self, shardings: Any) -> tuple[Any]:
        """The base on the devices, placed by `shardings` (the model's parameter shardings): `Program.frozen`."""
        if self._placed is None:
            self._placed = jax.device_put(self.base, shardings)
        return (self._placed,)

    def merged(self, adapters: Any) -> Any:
        """The base with the adapters merged (outside the step: benchmarks, rl's rollouts), dequantized if QLoRA's."""
        base = self.base if self._placed is None else self._placed
        base = quant.dequantize_base(base, self._abstract) if self.cfg.lora.quantize else base
        return lora.merge(base, adapters, self.scale)

    def loss(self, adapters: Any, batch: dict[str, jax.Array], key: jax.Array, base: Any) -> tuple[jax.Array, dict]:
        params = lora.overlay(jax.lax.stop_gradient(base), adapters, self.scale, self.cfg.lora.dropout,
                              jax.random.fold_in(key, LORA_DROPOUT_STREAM))
        return self.inner.loss(params, batch, key)

    def evaluate(self, adapters: Any, batch: dict[str, jax.Array], base: Any) -> Any:
        return self.inner.evaluate(lora.overlay(base, adapters, self.scale), batch)

    def pretrained(self) -> Any | None:
        """The adapters of config.lora.init_from (a PEFT directory), or None: initialized (B = 0); with
        modules_to_save, beside them the base's values of those parameters (the loop initializes what is missing)."""
        if not self.saved:
            return self.peft
        # taken here, not kept from __init__: the loop asks once (a fresh run), so no second host copy of those
        # parameters lives as long as the run (QLoRA leaves them float: modules_to_save may not name a kernel)
        return {**(self.peft or {}), **lora.saved_from(self.base, self.saved)}

    def check_resume(self, saved_meta: dict[str, Any], workdir: str) -> None:
        self.inner.check_resume(saved_meta, workdir)
        saved = saved_meta.get("lora")
        if saved is None or saved["base"]["sha256"] != self.meta["lora"]["base"]["sha256"]:
            what = "a run without LoRA" if saved is None else f"adapters of another base ({saved['base']['source']})"
            raise UserError(f"{workdir} holds {what}, not LoRA adapters of {self.cfg.init_from} as configured: use "
                            "the same init_from and config.lora, or a new --config.workdir")

    def describe(self) -> str:
        n, full = self._n_frozen, sum(leaf.value.size for leaf in self.saved.values())
        return "\n".join(line for line in (self.inner.describe(), (
            f"LoRA rank {self.cfg.lora.rank} (scale {self.scale:g}) on {', '.join(self.meta['lora']['targets'])}: "
            f"{len(self.sites)} adapters{f' and {full:,} parameters trained in full' if full else ''} beside "
            f"{n - full:,} frozen parameters of {self.cfg.init_from}"
            f"{f' ({self.cfg.lora.quantize} blocks)' if self.cfg.lora.quantize else ''}")) if line)


def adapt(task: Task, cfg: TrainConfig) -> Task:
    """`task` as configured: wrapped in `Adapted` when config.lora.rank is set, else unchanged."""
    return Adapted(task, cfg) if cfg.lora.rank else task
