"""Attention's inputs for tests, and its output and gradients through one implementation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.ops.attention import attend


def qkv(B: int, H: int, T: int, D: int, seed: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(k1, (B, T, H, D)), jax.random.normal(k2, (B, H, T, D)),
            jax.random.normal(k3, (B, H, T, D)))


def visible_mask(B: int, T: int, pad_BT: np.ndarray | None) -> jax.Array:
    """The model's mask: causal, padding keys hidden, every query sees itself (`GPT.hidden`)."""
    causal = jnp.tril(jnp.ones((1, T, T), bool))
    if pad_BT is None:
        return causal
    return (causal & ~jnp.asarray(pad_BT)[:, None, :]) | jnp.eye(T, dtype=bool)[None]


def outputs_and_grads(impl: str, q, k, v, visible, weight_BTHD):
    """y (B, T, H, D) and the gradients of sum(weight * y) with respect to q, k, v."""
    def f(q, k, v):
        y_BTHD = attend(q, k, v, visible, impl=impl, dtype="float32", causal=True)[0]
        return jnp.sum(weight_BTHD * y_BTHD), y_BTHD
    (_, y), grads = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return y, grads
