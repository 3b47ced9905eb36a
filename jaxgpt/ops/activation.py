"""The feed-forward layer's activation as each backend's autodiff should keep it for the backward pass.

The MLP applies its activation in float32 to the first product's 16-bit output and rounds the result once
(`jaxgpt.model.layers.MLP`). Differentiated as it stands, autodiff keeps that formula's float32 intermediates
(GELU's tanh and its neighbours) for the backward pass: on GPUs, where XLA fuses neither into the products
around them, they are the widest tensors a training step writes and reads back. There the activation is
`jax.checkpoint`ed, so the backward recomputes them from the product's output inside the fusion that needs them
(GPT-2 on an H100: docs/scaling.md, section 5). On TPUs the same checkpoint adds traffic instead and saves no
memory (GPT-2 compiled for a v5e slice, same section), and XLA:CPU's programs stay as they were.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxgpt.ops.platform import on_gpu

Array = jax.Array


def activate(fn: Callable[[Array], Array], u_BTF: Array, dtype: str) -> Array:
    """fn(u) computed in float32 and rounded once to `dtype`; recomputed in the backward pass on GPUs."""
    act = lambda u: fn(u.astype(jnp.float32)).astype(dtype)
    return jax.checkpoint(act)(u_BTF) if on_gpu() else act(u_BTF)
