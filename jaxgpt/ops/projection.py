"""Projections (y = x . kernel + bias) as each backend runs them fastest: the one projection the model calls.

`project` is what `jaxgpt.model.layers.EinsumDense` computes. It picks the path by platform, dtype and
the kernel's storage:
* any accelerator: one `lax.dot_general` contracting in the kernel's own axis order.
* XLA:CPU: the same product over x and the kernel flattened to matrices (`projection_dot_general`); in
  bfloat16 a custom VJP whose forward and backward products XLA:CPU runs natively in bf16, and a bias
  gradient written as a product (`add_bias`).
* output-major kernels (`OUTPUT_MAJOR`): every kernel stored as one (outputs, inputs) matrix, which one-row
  products read faster on CPUs and GPUs; the sampler stores them so for batch-1 decoding there
  (`jaxgpt.generate.decode_weights.output_major_for` says why).

Why the storage is a module attribute (`EinsumDense.kernel_storage`) rather than something the product
infers: flax checks a stored parameter's shape against the shape its module declares, so a module that
reads a (outputs, inputs) matrix must declare that shape (`stored_shape`); and a square 2-D kernel has the
same shape in both orders, so the stored array alone cannot tell its layout. The sampler gets the weights
and the storage name together from `jaxgpt.generate.decode_weights`; training and checkpoints only ever see DECLARED.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxgpt.ops.platform import current_platform

Array = jax.Array
DECLARED, OUTPUT_MAJOR = "declared", "output_major"  # kernel storages: `stored_shape`


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
    the weight gradient faster than in float32 (benchmarks/bench_cpu_products.py prints by how much).
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
    """`jax.lax.dot_general` for projections, as matrix products on CPUs.

    On XLA:CPU a projection whose contracted axes are x's last and the kernel's first (every projection of
    the GPT) runs as one (M, K) x (K, N) product of x and the kernel flattened to matrices (free reshapes).
    Left with several kernel axes (attention's (C, H, D) and (H, D, C) kernels), autodiff's input-gradient
    product contracts the kernel's output axes, and XLA:CPU copies the kernel transposed to run it, on every
    step, and lays the weight gradient out transposed, which the optimizer's update copies back: the flat
    product needs neither (docs/benchmarks.md, "SmolLM2 against transformers", measures it). In bfloat16 the
    product is a custom VJP: XLA:CPU multiplies bfloat16 natively (YNNPACK, bf16 x bf16 -> f32) only when a
    product asks for a float32 result and reads its operands untransposed, where a bf16 result or the
    transposes autodiff puts in front of the backward products make it convert both operands to float32 and
    run a float32 product, slower than float32 training; so the input-gradient product is written out
    transpose-free and the weight-gradient product reads slices of an explicit X^T. Same values as the plain
    product: float32 accumulation, rounded to `out_dtype` (by default x's dtype). Accelerators, and products
    of other shapes, run `lax.dot_general` as given.
    """
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    (x_dims, k_dims), batch = dimension_numbers
    n = len(x_dims)
    matrix = (batch == ((), ()) and list(x_dims) == list(range(x.ndim - n, x.ndim)) and list(k_dims) == list(range(n))
              and current_platform() == "cpu")
    if not matrix:
        return jax.lax.dot_general(x, kernel, dimension_numbers, precision=precision,
                                   preferred_element_type=out_dtype)
    K = math.prod(kernel.shape[:n])
    x_MK, w_KN = x.reshape(-1, K), kernel.reshape(K, -1)
    if x.dtype == kernel.dtype == jnp.bfloat16:
        y_MN = _bf16_matmul(x_MK, w_KN, out_dtype.name)
    else:
        y_MN = jax.lax.dot_general(x_MK, w_KN, (((1,), (0,)), ((), ())), precision=precision,
                                   preferred_element_type=out_dtype)
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
    splits a long one into a tree of reduce-window passes, whose emitter is slow, where the same sum as a
    product with rows of ones runs natively in YNNPACK (benchmarks/bench_train.py measures a bf16 step).
    Float32 and accelerators keep the plain sum.
    """
    if y.dtype != jnp.bfloat16 or bias.dtype != jnp.bfloat16 or current_platform() != "cpu":
        return y + bias
    return _bf16_bias_add(y, bias)


def einsum_in_kernel_order(spec: str, x: Array, kernel: Array, out_dtype: Any = None) -> Array:
    """`jnp.einsum(spec, x, kernel)` for projections (every axis x shares with the kernel is contracted).

    jnp.einsum picks its own order for several contracted axes ("bthd,hdc->btc" contracts (d, h)), and
    XLA then transposes the kernel and the activations to match, on every call: in batch-1 decoding,
    that copy of each output-projection kernel added to the weight traffic. Contracting in the
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


def stored_shape(kernel_shape: tuple[int, ...], n_out: int, storage: str) -> tuple[int, ...]:
    """The shape a kernel is stored in: as declared, or one (outputs, inputs) matrix (its last `n_out` axes
    are the outputs)."""
    if storage == DECLARED:
        return kernel_shape
    return math.prod(kernel_shape[-n_out:]), math.prod(kernel_shape[:-n_out])


def stored_init(init: nn.initializers.Initializer, kernel_shape: tuple[int, ...], n_out: int,
                storage: str) -> nn.initializers.Initializer:
    """`init` for the kernel in its storage: the declared kernel's values, laid out as `stored_shape` says."""
    if storage == DECLARED:
        return init
    K, N = math.prod(kernel_shape[:-n_out]), math.prod(kernel_shape[-n_out:])
    return lambda key, shape, dtype: nn.unbox(init(key, kernel_shape, dtype)).reshape(K, N).T


def project(spec: str, x: Array, kernel: Array, bias: Array | None, *, kernel_shape: tuple[int, ...],
            dtype: str, out_dtype: str, storage: str = DECLARED) -> Array:
    """`einsum(spec, x, kernel) + bias` for a projection (every axis x shares with the kernel is contracted).

    Declared kernels compute in `dtype` (x and the kernel are cast to it), output-major ones in the stored
    matrix's dtype (the sampler keeps it float32: XLA:CPU has no bf16 one-row product and would convert it
    on every call); the result is `out_dtype`, and the bias is added in it.
    """
    if storage == DECLARED:
        y = einsum_in_kernel_order(spec, x.astype(dtype), kernel.astype(dtype), out_dtype)
    else:
        y = einsum_output_major(spec, x.astype(kernel.dtype), kernel, kernel_shape, kernel.dtype).astype(out_dtype)
    return y if bias is None else add_bias(y, bias.astype(out_dtype))
