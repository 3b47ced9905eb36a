"""The building blocks the models share: initializers with logical axis names, projections, norms, the MLP.

Shapes are named in variable suffixes: B batch, T length, C n_embd, H heads, D head_dim, F d_ff.
Every parameter carries logical axis names (`nn.with_logical_partitioning`); the table in
`jaxgpt.train.sharding` maps them onto a device mesh, so no module ever mentions devices.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxgpt.model.config import ModelConfig
from jaxgpt.ops import kernels

Array = jax.Array

ACTIVATIONS = {
    "relu": nn.relu,
    "gelu": lambda x: nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: nn.gelu(x, approximate=True),
}


def _uniform(bound: float) -> nn.initializers.Initializer:
    def init(key: Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> Array:
        return jax.random.uniform(key, shape, dtype, -bound, bound)
    return init


def param_init(cfg: ModelConfig, names: tuple[str | None, ...], *, residual: bool = False,
               fans: tuple[int, int] | None = None, role: str = "attn") -> nn.initializers.Initializer:
    """Weight init with logical names, by `cfg.init` (the rules are listed at `config.INITS`).

    GPT-2 shrinks the residual projections by 1/sqrt(2 L) so the residual stream's variance
    does not grow with depth. Xavier and PyTorch's default bound 1/sqrt(fan_in) take (fan_in, fan_out)
    per projection when given, so the fused (C, 3, H, D) kernel gets the bounds of three separate
    (C, H*D) matrices. `role` ("attn", "mlp", "token", "position", "head", "classes") matters only to
    gpt1_torch: seed 001 initializes some modules explicitly and leaves the others at PyTorch's defaults.
    """
    if cfg.init in ("xavier", "xavier_torch"):
        def init(key: Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> Array:
            fan_in, fan_out = fans or (shape[-2], shape[-1])
            return _uniform(math.sqrt(6.0 / (fan_in + fan_out)))(key, shape, dtype)
    elif cfg.init == "gpt1_torch" and role in ("attn", "head"):  # nn.Linear's kaiming_uniform(a=sqrt(5))
        def init(key: Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> Array:
            return _uniform(1.0 / math.sqrt((fans or shape[-2:])[0]))(key, shape, dtype)
    elif cfg.init == "gpt1_torch":  # explicit normal(0.02) inits; the position table keeps nn.Embedding's N(0, 1)
        init = nn.initializers.normal(1.0 if role == "position" else 0.02)
    else:
        init = nn.initializers.normal(0.02 / math.sqrt(2 * cfg.n_layer) if residual else 0.02)
    return nn.with_logical_partitioning(init, names)


def bias_init(cfg: ModelConfig, names: tuple[str | None, ...], fan_in: int,
              role: str = "attn") -> nn.initializers.Initializer:
    """Projection biases: zero, except under the PyTorch inits, whose nn.Linear biases are U(+-1/sqrt(fan_in)).

    Seed 001's classifier head calls `normal_(bias, 0)`, which sets the mean and keeps the default std 1.
    """
    if cfg.init == "gpt1_torch" and role == "classes":
        init = nn.initializers.normal(1.0)
    elif cfg.init in ("xavier_torch", "gpt1_torch"):
        init = _uniform(1.0 / math.sqrt(fan_in))
    else:
        init = nn.initializers.zeros
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _bf16_matmul(x_MK: Array, w_KN: Array, out_dtype: str) -> Array:
    return jax.lax.dot_general(x_MK, w_KN, (((1,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32).astype(out_dtype)


def _bf16_matmul_fwd(x_MK: Array, w_KN: Array, out_dtype: str) -> tuple[Array, tuple[Array, Array]]:
    return _bf16_matmul(x_MK, w_KN, out_dtype), (x_MK, w_KN)


def _weight_gradient(x_MK: Array, dy_MN: Array) -> Array:
    """X^T dY in float32, as two products over the halves of the rows, each reading a slice of X^T.

    Written as one product (contracting X's leading axis, or reading X^T whole) XLA:CPU converts both
    operands to float32 first; slices of an explicit X^T are read as bf16 by YNNPACK, which makes
    the weight gradient about 2x faster than in float32 (benchmarks/bench_cpu_products.py).
    """
    if dy_MN.shape[1] < x_MK.shape[1]:  # dW^T = dY^T X transposes the narrower operand (the MLP's proj: 4x)
        return _weight_gradient(dy_MN, x_MK).T
    xT_KM = jax.lax.optimization_barrier(x_MK.T)  # materialized: XLA would fold a bare transpose back
    h = x_MK.shape[0] // 2
    dot = lambda a, b: jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return dot(xT_KM[:, :h], dy_MN[:h]) + dot(xT_KM[:, h:], dy_MN[h:])


def _bf16_matmul_bwd(_: str, res: tuple[Array, Array], dy_MN: Array) -> tuple[Array, Array]:
    x_MK, w_KN = res
    dy_MN = dy_MN.astype(x_MK.dtype)
    dx_MK = jax.lax.dot_general(dy_MN, w_KN, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return dx_MK.astype(x_MK.dtype), _weight_gradient(x_MK, dy_MN).astype(w_KN.dtype)


_bf16_matmul.defvjp(_bf16_matmul_fwd, _bf16_matmul_bwd)


def projection_dot_general(x: Array, kernel: Array, dimension_numbers: Any, precision: Any = None,
                           out_dtype: Any = None) -> Array:
    """`jax.lax.dot_general` for projections, with bfloat16 products that XLA:CPU runs natively.

    XLA:CPU multiplies bfloat16 natively (YNNPACK, bf16 x bf16 -> f32) only when a product asks for a
    float32 result and reads its operands untransposed. A bf16 result, or the transposes autodiff puts
    in front of the backward products, make it convert both operands to float32 and run a float32
    product instead, slower than float32 training. So on CPUs the bf16 products of a projection whose
    contracted axes are x's last and the kernel's first (every projection of the GPT) run as one
    (M, K) x (K, N) product whose input-gradient product is written out transpose-free and whose
    weight-gradient product reads slices of an explicit X^T (a custom VJP). Same values as the plain
    product: float32 accumulation, rounded to bfloat16 (or to `out_dtype`, by default x's dtype).
    """
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    (x_dims, k_dims), batch = dimension_numbers
    n = len(x_dims)
    plain = (x.dtype != jnp.bfloat16 or kernel.dtype != jnp.bfloat16 or batch != ((), ())
             or list(x_dims) != list(range(x.ndim - n, x.ndim)) or list(k_dims) != list(range(n))
             or kernels.current_platform() != "cpu")
    if plain:
        return jax.lax.dot_general(x, kernel, dimension_numbers, precision=precision,
                                   preferred_element_type=out_dtype)
    K = math.prod(kernel.shape[:n])
    y_MN = _bf16_matmul(x.reshape(-1, K), kernel.reshape(K, -1), out_dtype.name)
    return y_MN.reshape(*x.shape[:x.ndim - n], *kernel.shape[n:])


@jax.custom_vjp
def _bf16_bias_add(y: Array, bias: Array) -> Array:
    return y + bias


def _bf16_bias_add_fwd(y: Array, bias: Array) -> tuple[Array, Array]:
    return y + bias, bias


def _bf16_bias_add_bwd(bias: Array, dy: Array) -> tuple[Array, Array]:
    dy_MN = dy.reshape(-1, bias.size)
    ones_2M = jnp.ones((2, dy_MN.shape[0]), dy.dtype)  # two rows: a one-row product is not YNNPACK's
    db_N = jax.lax.dot_general(ones_2M, dy_MN, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)[0]
    return dy, db_N.reshape(bias.shape).astype(bias.dtype)


_bf16_bias_add.defvjp(_bf16_bias_add_fwd, _bf16_bias_add_bwd)


def add_bias(y: Array, bias: Array) -> Array:
    """`y + bias` (bias over y's trailing axes), with a bias gradient that XLA:CPU computes fast in bfloat16.

    The gradient is the sum of the cotangent over every row. XLA:CPU upcasts a bf16 sum to float32 and
    splits a long one into a tree of reduce-window passes, whose emitter is slow: 25 ms for the fc bias
    of a 6x6x384 step at 16 x 256 tokens, where the same sum as a product with rows of ones runs natively
    in YNNPACK in well under a millisecond. Float32 and accelerators keep the plain sum.
    """
    if y.dtype != jnp.bfloat16 or bias.dtype != jnp.bfloat16 or kernels.current_platform() != "cpu":
        return y + bias
    return _bf16_bias_add(y, bias)


def einsum_in_kernel_order(spec: str, x: Array, kernel: Array, out_dtype: Any = None) -> Array:
    """`jnp.einsum(spec, x, kernel)` for projections (every axis x shares with the kernel is contracted).

    jnp.einsum picks its own order for several contracted axes ("bthd,hdc->btc" contracts (d, h)), and
    XLA then transposes the kernel and the activations to match, on every call: in batch-1 decoding,
    that copy of each output-projection kernel added a sixth to the weight traffic. Contracting in the
    kernel's own axis order needs no copy.
    """
    x_axes, k_axes, shared, to_out = _projection_axes(spec)
    dims = ([x_axes.index(a) for a in shared], [k_axes.index(a) for a in shared])
    return projection_dot_general(x, kernel, (dims, ((), ())), out_dtype=out_dtype).transpose(to_out)


def _projection_axes(spec: str) -> tuple[str, str, list[str], list[int]]:
    """A projection's einsum spec -> (x's axes, the kernel's, the contracted ones in the kernel's order,
    the transpose from the product's axes (x's free ones, then the kernel's) to the output's)."""
    inputs, out = spec.split("->")
    x_axes, k_axes = inputs.split(",")
    shared = [a for a in k_axes if a in x_axes]
    y_axes = [a for a in x_axes + k_axes if a not in shared]
    return x_axes, k_axes, shared, [y_axes.index(a) for a in out]


_OUTPUT_MAJOR = contextvars.ContextVar("kernels_output_major", default=False)


@contextlib.contextmanager
def kernels_output_major(enabled: bool = True) -> Iterator[None]:
    """Within it, every EinsumDense kernel is one (outputs, inputs) matrix, as `model.output_major_kernels` stores it.

    For batch-1 decoding on CPUs (`sampling`): XLA:CPU's one-row product streams a matrix whose every
    output is one contiguous dot faster than a (K, N) one (GPT-2 shape, per token: qkv 150 -> 130 us,
    fc 215 -> 176, proj 243 -> 199). The product must read that matrix as stored: a transpose in front of
    it (undoing the layout in the program) is copied on every call or fused into a slower loop. The
    product runs in the matrix's dtype: the sampler stores it in float32 even for a bf16 model, since
    XLA:CPU has no bf16 one-row product and would convert it to float32 on every call anyway.
    """
    token = _OUTPUT_MAJOR.set(enabled)
    try:
        yield
    finally:
        _OUTPUT_MAJOR.reset(token)


def einsum_output_major(spec: str, x: Array, kernel_NK: Array, kernel_shape: tuple[int, ...],
                        out_dtype: Any) -> Array:
    """`einsum_in_kernel_order` for a kernel of `kernel_shape` stored as one (outputs, inputs) matrix.

    Not `einsum_in_kernel_order` on the matrix reshaped to (outputs..., inputs...): XLA canonicalizes a
    product whose kernel has several free axes by moving the contracted axes first, which copies the
    kernel on every token (test_sampling's output-major HLO test fails that way). Only a 2-D matrix is
    read in place, so x is flattened to (..., K) instead.
    """
    x_axes, _, shared, to_out = _projection_axes(spec)  # shared: the kernel's leading axes
    rest = [a for a in x_axes if a not in shared]
    x = x.transpose([x_axes.index(a) for a in rest + shared])
    x_MK = x.reshape(*x.shape[:len(rest)], kernel_NK.shape[1])
    y = jax.lax.dot_general(x_MK, kernel_NK, (((len(rest),), (1,)), ((), ())), preferred_element_type=out_dtype)
    return y.reshape(*x.shape[:len(rest)], *kernel_shape[len(shared):]).transpose(to_out)


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
    role: str = "attn"  # for `param_init`
    out_dtype: str | None = None  # y's dtype (None: the model's); attention asks for its own, `attention.work_dtype`

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.cfg
        init = param_init(cfg, self.kernel_names, residual=self.residual, fans=self.fans, role=self.role)
        out_dtype = self.out_dtype or cfg.dtype
        n_out = len(self.bias_names)  # the kernel's output axes, its last ones
        K, N = math.prod(self.kernel_shape[:-n_out]), math.prod(self.kernel_shape[-n_out:])
        if _OUTPUT_MAJOR.get():
            flat = lambda key, shape, dtype: nn.unbox(init(key, self.kernel_shape, dtype)).reshape(K, N).T
            kernel_NK = self.param("kernel", flat, (N, K), cfg.param_dtype)
            y = einsum_output_major(self.spec, x.astype(kernel_NK.dtype), kernel_NK, self.kernel_shape,
                                    kernel_NK.dtype).astype(out_dtype)
        else:
            kernel = self.param("kernel", init, self.kernel_shape, cfg.param_dtype)
            y = einsum_in_kernel_order(self.spec, x.astype(cfg.dtype), kernel.astype(cfg.dtype), out_dtype)
        if cfg.use_bias:
            fan_in = self.fans[0] if self.fans else K
            y = add_bias(y, self.param("bias", bias_init(cfg, self.bias_names, fan_in), self.kernel_shape[-n_out:],
                                       cfg.param_dtype).astype(out_dtype))
        return y


class MLP(nn.Module):
    """Position-wise feed-forward: C -> F -> C with the configured activation."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BTC: Array, deterministic: bool) -> Array:
        cfg = self.cfg
        C, F = cfg.n_embd, cfg.d_ff
        fc = EinsumDense(cfg, "btc,cf->btf", (C, F), ("embed", "mlp"), ("mlp",), role="mlp", name="fc")
        proj = EinsumDense(cfg, "btf,fc->btc", (F, C), ("mlp", "embed"), ("embed",), residual=True, role="mlp",
                           name="proj")
        # in float32, rounded once: a bf16 GELU rounds after each operation of its formula, which is both
        # less accurate and, on XLA:CPU, a slower pass (a bf16 (b) step: 652 -> 587 ms)
        h_BTF = ACTIVATIONS[cfg.activation](fc(x_BTC).astype(jnp.float32)).astype(cfg.dtype)
        h_BTF = nn.with_logical_constraint(h_BTF, ("batch", "length", "act_mlp"))
        h_BTF = nn.Dropout(cfg.ff_dropout)(h_BTF, deterministic=deterministic)
        return proj(h_BTF)
