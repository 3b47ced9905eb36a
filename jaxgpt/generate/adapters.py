"""Several LoRA adapters decoded in one continuous batch: their stacked form, and which row uses which.

The engine (`jaxgpt.generate.engine`) serves a base model and N adapters of it at once. The adapters are stacked
once, on the device, in the model's stacked form (`jaxgpt.model.lora.project_adapters`): per target, every
adapter's A and B packed side by side along the rank axis, A (*in, R) and B (R, *out) with R the sum of their
ranks, so that x A is one product as wide as the ranks together and nothing is padded to the largest rank (with
ranks 4 to 16 on every linear layer of bench_serve's model, padding read a quarter more weights per block than the
base's own, packing reads a sixth).
Adapter n owns the same columns in every target (as many as its largest rank; a target it adapts with a smaller
rank, or leaves out, is zeros in the rest, which add exactly nothing), and its scale is folded into its B. The
stack sits beside the base's kernels in one parameter tree (`lora.overlay`), so no kernel is copied or merged.

Each decode step and prefill then adds to that tree every target's `rows`, the mask (Bt, R) of the columns each
row uses (its adapter's; all zeros: the base alone), from the slots' state: every adapter's A and B is read once
per step whatever the mix of rows, which is what lets rows of different adapters share a batch. Scanned layers
carry their layers axis first: A (L, *in, R), and `rows` broadcast to (L, Bt, R) so that the scan slices it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.errors import UserError
from jaxgpt.model import lora
from jaxgpt.model.config import ModelConfig
from jaxgpt.model.gpt import stack_layers, unstack_layers

ROWS = "rows"  # the key of each target's row mask beside its lora_a and lora_b


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One adapter to serve: its name (a request's `model`), its tree in the model's single form (host arrays,
    laid out as the served model's parameters: scanned or not), and its scale s (alpha / r)."""

    name: str
    tree: Mapping[str, Any]
    scale: float


@dataclasses.dataclass(frozen=True)
class Stack:
    """Adapters in the stacked form: `names[n]` owns rank columns `starts[n]` to `starts[n + 1]` of every target;
    `tree` (host arrays) is what `lora.overlay` lays beside the base's kernels (scales already folded into B)."""

    names: tuple[str, ...]
    tree: dict[str, Any]
    starts: tuple[int, ...]  # each adapter's first column, then the width R

    @property
    def width(self) -> int:
        """R, the rank columns of the adapters together (the length of a row's mask)."""
        return self.starts[-1]


def columns_of(served: Stack | None, name: str | None) -> np.ndarray | None:
    """The mask (R,) over the rank columns of the adapters `served` that a request of adapter `name` decodes with:
    1 on that adapter's columns (None, the base alone: zeros); None when no adapters are served (the engine then
    keeps no adapter state)."""
    if served is None:
        return None
    mask_R = np.zeros(served.width, np.float32)
    if name is not None:
        if name not in served.names:
            raise UserError(f"no adapter named {name!r} is served: choose among {', '.join(served.names)}")
        n = served.names.index(name)
        mask_R[served.starts[n]:served.starts[n + 1]] = 1.0
    return mask_R


def beside(params: Mapping[str, Any], served: Stack | None) -> Mapping[str, Any]:
    """The base's (decoding) parameters with the stack laid beside their kernels, on their device (`lora.overlay`,
    at scale 1: the scales are in B already); `params` as they are when no adapters are served."""
    if served is None:
        return params
    device = jax.tree.leaves(params)[0].devices().pop()
    return lora.overlay(params, jax.device_put(served.tree, device), 1.0)


def stack(adapters: Sequence[Adapter], cfg: ModelConfig) -> Stack:
    """The stacked form of `adapters` on a model of `cfg`: every target any of them adapts, their ranks packed side
    by side (each adapter as wide as its largest rank), scales folded into B. Layers are stacked per layer (`h_i`),
    then scanned again if `cfg` scans."""
    if not adapters:
        raise UserError("stack: give at least one adapter")
    listed = [unstack_layers(dict(a.tree), cfg.n_layer) if cfg.scan_layers else a.tree for a in adapters]
    found: dict[tuple[tuple[str, ...], str], list[tuple[np.ndarray, np.ndarray] | None]] = {}
    ranks = [0] * len(adapters)
    for n, (adapter, tree) in enumerate(zip(adapters, listed, strict=True)):
        for module, target, ab in lora.adapter_leaves(tree):
            a = np.asarray(ab["lora_a"], np.float32)
            b = np.asarray(ab["lora_b"], np.float32) * np.float32(adapter.scale)
            found.setdefault((module, target), [None] * len(adapters))[n] = (a, b)
            ranks[n] = max(ranks[n], a.shape[-1])
    starts = tuple(int(c) for c in np.cumsum([0, *ranks]))
    out: dict[str, Any] = {}
    for (module, target), per_adapter in found.items():
        a0, b0 = next(ab for ab in per_adapter if ab is not None)
        a_R = np.zeros((*a0.shape[:-1], starts[-1]), np.float32)
        b_R = np.zeros((starts[-1], *b0.shape[1:]), np.float32)
        for n, ab in enumerate(per_adapter):
            if ab is not None:
                a_R[..., starts[n]:starts[n] + ab[0].shape[-1]], b_R[starts[n]:starts[n] + ab[1].shape[0]] = ab
        node = out
        for key in (*module, target):
            node = node.setdefault(key, {})
        node.update(lora_a=a_R, lora_b=b_R)
    tree = stack_layers(out, cfg.n_layer) if cfg.scan_layers else out
    return Stack(tuple(a.name for a in adapters), tree, starts)


def with_rows(params: Mapping[str, Any], mask_BR: jax.Array | None, cfg: ModelConfig) -> Mapping[str, Any]:
    """`params` (the base with a stack laid beside its kernels) with `rows` beside every target's lora_a, for B
    rows (a prefill's prompts, or one row of a decode step under `jax.vmap`), each using the rank columns its
    row of `mask_BR` selects (`columns_of`: one adapter's, or none: the base alone); None (no adapters served):
    `params` as they are. Under scanned layers (`h`) the rows gain the layers axis."""
    if mask_BR is None:
        return params

    def put(node: Any, scanned: bool) -> Any:
        if not isinstance(node, Mapping):
            return node
        if "lora_a" in node:
            return {**node, ROWS: jnp.broadcast_to(mask_BR, (cfg.n_layer, *mask_BR.shape)) if scanned else mask_BR}
        return {key: put(sub, scanned) for key, sub in node.items()}

    return {key: put(sub, cfg.scan_layers and key == "h") for key, sub in params.items()}
