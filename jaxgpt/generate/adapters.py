"""Several LoRA adapters decoded in one continuous batch: their stacked form, and which row uses which.

The engine (`jaxgpt.generate.engine`) serves a base model and N adapters of it at once. The adapters are stacked
once, on the device, in the model's stacked form (`jaxgpt.model.lora`, docs: the adapter interface): per target,
A (N, *in, R) and B (N, R, *out), R the largest rank among them (a smaller rank is padded with zeros, which adds
exactly nothing), each adapter's scale folded into its B, and an adapter that leaves a target out zeros there.
The stack sits beside the base's kernels in one parameter tree (`lora.overlay`), so no kernel is copied or merged.

Each decode step and prefill then adds to that tree every target's `rows`, the one-hot (Bt, N) of which adapter
each row uses (all zeros: the base alone), from the slots' state: every adapter's A and B is read once per step
whatever the mix of rows, which is what lets rows of different adapters share a batch. Scanned layers carry their
layers axis first: A (L, N, *in, R), and `rows` broadcast to (L, Bt, N) so that the scan slices it with them.
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

ROWS = "rows"  # the key of each target's one-hot rows beside its lora_a and lora_b


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One adapter to serve: its name (a request's `model`), its tree in the model's single form (host arrays,
    laid out as the served model's parameters: scanned or not), and its scale s (alpha / r)."""

    name: str
    tree: Mapping[str, Any]
    scale: float


@dataclasses.dataclass(frozen=True)
class Stack:
    """Adapters in the stacked form: `names[n]` is row n of every one-hot; `tree` (host arrays) is what
    `lora.overlay` lays beside the base's kernels (scales already folded into B)."""

    names: tuple[str, ...]
    tree: dict[str, Any]

    def __len__(self) -> int:
        return len(self.names)


def one_hot(served: Stack | None, name: str | None) -> np.ndarray | None:
    """The one-hot (N,) of adapter `name` among those `served` (None, the base alone: zeros); None when no
    adapters are served (the engine then keeps no adapter state)."""
    if served is None:
        return None
    row_N = np.zeros(len(served), np.float32)
    if name is not None:
        if name not in served.names:
            raise UserError(f"no adapter named {name!r} is served: choose among {', '.join(served.names)}")
        row_N[served.names.index(name)] = 1.0
    return row_N


def beside(params: Mapping[str, Any], served: Stack | None) -> Mapping[str, Any]:
    """The base's (decoding) parameters with the stack laid beside their kernels, on their device (`lora.overlay`,
    at scale 1: the scales are in B already); `params` as they are when no adapters are served."""
    if served is None:
        return params
    device = jax.tree.leaves(params)[0].devices().pop()
    return lora.overlay(params, jax.device_put(served.tree, device), 1.0)


def stack(adapters: Sequence[Adapter], cfg: ModelConfig) -> Stack:
    """The stacked form of `adapters` on a model of `cfg`: every target any of them adapts, ranks padded to the
    largest, scales folded into B. Layers are stacked per layer (`h_i`), then scanned again if `cfg` scans."""
    if not adapters:
        raise UserError("stack: give at least one adapter")
    listed = [unstack_layers(dict(a.tree), cfg.n_layer) if cfg.scan_layers else a.tree for a in adapters]
    found: dict[tuple[tuple[str, ...], str], list[tuple[np.ndarray, np.ndarray] | None]] = {}
    for n, (adapter, tree) in enumerate(zip(adapters, listed, strict=True)):
        for module, target, ab in lora.adapter_leaves(tree):
            a = np.asarray(ab["lora_a"], np.float32)
            b = np.asarray(ab["lora_b"], np.float32) * np.float32(adapter.scale)
            found.setdefault((module, target), [None] * len(adapters))[n] = (a, b)
    out: dict[str, Any] = {}
    for (module, target), per_adapter in found.items():
        a0, b0 = next(ab for ab in per_adapter if ab is not None)
        R = max(a.shape[-1] for a, _ in filter(None, per_adapter))
        a_N = np.zeros((len(adapters), *a0.shape[:-1], R), np.float32)
        b_N = np.zeros((len(adapters), R, *b0.shape[1:]), np.float32)
        for n, ab in enumerate(per_adapter):
            if ab is not None:
                a_N[n, ..., :ab[0].shape[-1]], b_N[n, :ab[1].shape[0]] = ab
        node = out
        for key in (*module, target):
            node = node.setdefault(key, {})
        node.update(lora_a=a_N, lora_b=b_N)
    return Stack(tuple(a.name for a in adapters), stack_layers(out, cfg.n_layer) if cfg.scan_layers else out)


def with_rows(params: Mapping[str, Any], adapter_N: jax.Array | None, cfg: ModelConfig) -> Mapping[str, Any]:
    """`params` (the base with a stack laid beside its kernels) with `rows` beside every target's lora_a, for one
    row (a prefill's, or a decode step's under `jax.vmap`) that uses the adapters `adapter_N` selects (one-hot,
    or zeros: the base alone); None (no adapters served): `params` as they are. Under scanned layers (`h`) the
    rows gain the layers axis."""
    if adapter_N is None:
        return params
    rows_1N = adapter_N[None]

    def put(node: Any, scanned: bool) -> Any:
        if not isinstance(node, Mapping):
            return node
        if "lora_a" in node:
            return {**node, ROWS: jnp.broadcast_to(rows_1N, (cfg.n_layer, *rows_1N.shape)) if scanned else rows_1N}
        return {key: put(sub, scanned) for key, sub in node.items()}

    return {key: put(sub, cfg.scan_layers and key == "h") for key, sub in params.items()}
