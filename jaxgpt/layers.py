"""The building blocks the models share: initializers with logical axis names, projections, norms, the MLP.

Shapes are named in variable suffixes: B batch, T length, C n_embd, H heads, D head_dim, F d_ff.
Every parameter carries logical axis names (`nn.with_logical_partitioning`); the table in
`jaxgpt.layout` maps them onto a device mesh, so no module ever mentions devices.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxgpt.config import ModelConfig

Array = jax.Array

ACTIVATIONS = {
    "relu": nn.relu,
    "gelu": lambda x: nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: nn.gelu(x, approximate=True),
}


def param_init(cfg: ModelConfig, names: tuple[str | None, ...], *, residual: bool = False,
               fans: tuple[int, int] | None = None) -> nn.initializers.Initializer:
    """Weight init with logical names: GPT-2 normal(0.02) or seed 000's Xavier uniform.

    GPT-2 shrinks the residual projections by 1/sqrt(2 L) so the residual stream's variance
    does not grow with depth. Xavier takes (fan_in, fan_out) per projection when given, so the
    fused (C, 3, H, D) kernel gets the bounds of three separate (C, H*D) matrices.
    """
    if cfg.init == "xavier":
        def init(key: Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> Array:
            fan_in, fan_out = fans or (shape[-2], shape[-1])
            bound = math.sqrt(6.0 / (fan_in + fan_out))
            return jax.random.uniform(key, shape, dtype, -bound, bound)
    else:
        init = nn.initializers.normal(0.02 / math.sqrt(2 * cfg.n_layer) if residual else 0.02)
    return nn.with_logical_partitioning(init, names)


def zeros_init(names: tuple[str | None, ...]) -> nn.initializers.Initializer:
    return nn.with_logical_partitioning(nn.initializers.zeros, names)


class Norm(nn.Module):
    """LayerNorm, or seed 000's variant that divides by (unbiased std + eps).

    Statistics are computed in float32 whatever the compute dtype: bf16 means lose too much.
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.cfg
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        if cfg.norm == "layernorm":
            y = (x32 - mean) * jax.lax.rsqrt(x32.var(-1, keepdims=True) + cfg.norm_eps)
        else:
            y = (x32 - mean) / (jnp.std(x32, axis=-1, keepdims=True, ddof=1) + cfg.norm_eps)
        y = y * self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                           (x.shape[-1],), cfg.param_dtype)
        if cfg.use_bias:
            y = y + self.param("bias", zeros_init(("norm",)), (x.shape[-1],), cfg.param_dtype)
        return y.astype(cfg.dtype)


def einsum_in_kernel_order(spec: str, x: Array, kernel: Array) -> Array:
    """`jnp.einsum(spec, x, kernel)` for projections (every axis x shares with the kernel is contracted).

    jnp.einsum picks its own order for several contracted axes ("bthd,hdc->btc" contracts (d, h)), and
    XLA then transposes the kernel and the activations to match, on every call: in batch-1 decoding,
    that copy of each output-projection kernel added a sixth to the weight traffic. Contracting in the
    kernel's own axis order needs no copy.
    """
    inputs, out = spec.split("->")
    x_axes, k_axes = inputs.split(",")
    shared = [a for a in k_axes if a in x_axes]
    dims = ([x_axes.index(a) for a in shared], [k_axes.index(a) for a in shared])
    y = jax.lax.dot_general(x, kernel, (dims, ((), ())))
    y_axes = [a for a in x_axes + k_axes if a not in shared]
    return y.transpose([y_axes.index(a) for a in out])


class EinsumDense(nn.Module):
    """A projection with a multi-axis kernel: y = einsum(spec, x, kernel) + bias.

    Keeping heads as their own kernel axis lets the sharding rules split them (tensor parallelism)
    without reshapes, and the initializer sees the true shape (DenseGeneral flattens it).
    """

    cfg: ModelConfig
    spec: str
    kernel_shape: tuple[int, ...]
    kernel_names: tuple[str | None, ...]
    bias_names: tuple[str | None, ...]
    residual: bool = False
    fans: tuple[int, int] | None = None

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.cfg
        kernel = self.param("kernel", param_init(cfg, self.kernel_names, residual=self.residual, fans=self.fans),
                            self.kernel_shape, cfg.param_dtype)
        y = einsum_in_kernel_order(self.spec, x.astype(cfg.dtype), kernel.astype(cfg.dtype))
        if cfg.use_bias:
            bias_shape = self.kernel_shape[-len(self.bias_names):]
            y = y + self.param("bias", zeros_init(self.bias_names), bias_shape, cfg.param_dtype).astype(cfg.dtype)
        return y


class MLP(nn.Module):
    """Position-wise feed-forward: C -> F -> C with the configured activation."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BTC: Array, deterministic: bool) -> Array:
        cfg = self.cfg
        dense = lambda n, names, name, residual=False: nn.Dense(
            n, use_bias=cfg.use_bias, dtype=cfg.dtype, param_dtype=cfg.param_dtype, name=name,
            kernel_init=param_init(cfg, names, residual=residual), bias_init=zeros_init(names[1:]))
        h_BTF = ACTIVATIONS[cfg.activation](dense(cfg.d_ff, ("embed", "mlp"), "fc")(x_BTC))
        h_BTF = nn.with_logical_constraint(h_BTF, ("batch", "length", "act_mlp"))
        h_BTF = nn.Dropout(cfg.ff_dropout)(h_BTF, deterministic=deterministic)
        return dense(cfg.n_embd, ("mlp", "embed"), "proj", residual=True)(h_BTF)
