"""Projections on CPUs: float32 and bfloat16 products (bf16 ones native), and bf16 loss curves that track float32."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import load_tiny

from jaxgpt.data.dataset import load_dataset
from jaxgpt.model.gpt import init_params
from jaxgpt.ops.projection import add_bias, projection_dot_general
from jaxgpt.tasks.lm import LanguageModelling
from jaxgpt.train.config import from_config_dict
from jaxgpt.train.optim import make_optimizer
from jaxgpt.train.step import make_train_step

pytestmark = pytest.mark.jax_release

# (spec of a projection, x shape, kernel shape): the GPT's fused QKV, MLP (fc, proj) and output projections
PROJECTIONS = [((((2,), (0,)), ((), ())), (2, 16, 32), (32, 3, 4, 8)),
               ((((2,), (0,)), ((), ())), (2, 16, 32), (32, 128)),
               ((((2,), (0,)), ((), ())), (2, 16, 128), (128, 32)),
               ((((2, 3), (0, 1)), ((), ())), (2, 16, 4, 8), (4, 8, 32))]


def _value_and_grads(dot_general, dims, x, kernel, cotangent):
    y, vjp = jax.vjp(lambda a, b: dot_general(a, b, dims), x, kernel)
    return (y, *vjp(cotangent))


@pytest.mark.parametrize("dims,x_shape,kernel_shape", PROJECTIONS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_projection_matches_dot_general(dims, x_shape, kernel_shape, dtype):
    """Value and both gradients equal lax.dot_general's in float32 up to the order of float32 sums (on CPUs the
    product runs over x and the kernel flattened to matrices), and in bfloat16 are the float32 products rounded
    once. In bfloat16 the reference is float32, not lax's own bf16 product: since jax 0.11 XLA:CPU accumulates a
    plain bf16 weight gradient with bf16 partial sums (7 ulps off at K = 32 rows)."""
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], x_shape).astype(dtype)
    kernel = jax.random.normal(keys[1], kernel_shape).astype(dtype)
    n = len(dims[0][0])
    cotangent = jax.random.normal(keys[2], x_shape[:-n] + kernel_shape[n:]).astype(dtype)
    ours = jax.jit(lambda *a: _value_and_grads(projection_dot_general, dims, *a))(x, kernel, cotangent)
    f32 = [a.astype(jnp.float32) for a in (x, kernel, cotangent)]
    with jax.default_matmul_precision("highest"):
        plain = jax.jit(lambda *a: _value_and_grads(jax.lax.dot_general, dims, *a))(*f32)
    for a, b in zip(ours, plain, strict=True):
        assert a.dtype == dtype and a.shape == b.shape
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if dtype == "float32":  # sums of 32-128 products: a few float32 ulps of the largest
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max())
        else:  # half a bf16 ulp (2^-9 relative) plus float32 summation order
            np.testing.assert_allclose(a, b, rtol=2**-8, atol=1e-3 * np.abs(b).max())


@pytest.mark.parametrize("dims,x_shape,kernel_shape", PROJECTIONS)
def test_float32_gradients_copy_no_kernel_on_cpu(dims, x_shape, kernel_shape):
    """On CPUs a float32 projection's product and both gradients read x and the kernel as stored: with the
    kernel's several axes left to the product, XLA:CPU copied it transposed for the input gradient, on every
    step, and laid the weight gradient out transposed (`projection_dot_general`)."""
    x, kernel = jnp.ones(x_shape), jnp.ones(kernel_shape)
    loss = lambda x, kernel: jnp.sum(jnp.sin(projection_dot_general(x, kernel, dims)))
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, kernel).compile().as_text()
    moved = [line.strip()[:120] for line in hlo.splitlines() if re.search(r"= \S+ (transpose|copy)\(", line)]
    assert not moved, moved


@pytest.mark.parametrize("K,N", [(64, 128), (128, 64)])
def test_bf16_products_run_as_bf16_on_cpu(K: int, N: int):
    """The forward, input-gradient and both halves of the weight-gradient product of a bf16 projection
    read bf16 operands in the compiled program, whichever of X and dY the weight gradient transposes;
    plain lax.dot_general's are not all (on jax 0.10's XLA:CPU none is, which made bf16 training slow;
    since jax 0.11 two of its three products are)."""
    x, kernel, weights = (jnp.ones(shape, jnp.bfloat16) for shape in ((256, K), (K, N), (256, N)))
    dims = (((1,), (0,)), ((), ()))

    def bf16_operand_dots(dot_general):
        loss = lambda a, b, w: (dot_general(a, b, dims) * w).astype(jnp.float32).sum()
        hlo = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, kernel, weights).compile().as_text()
        types = {m[0]: m[1] for m in re.findall(r"%([\w.\-]+) = (\w+)\[", hlo)}
        operands = [re.search(r"dot\(%([\w.\-]+), %([\w.\-]+)\)", line).groups()
                    for line in hlo.splitlines() if " dot(" in line]
        return sum(all(types[o] == "bf16" for o in pair) for pair in operands)

    if jax.default_backend() != "cpu":
        pytest.skip("a CPU-only rewrite")
    assert bf16_operand_dots(projection_dot_general) == 4
    assert bf16_operand_dots(jax.lax.dot_general) < 4


def _loss_curve(data_dir, dtype: str, steps: int) -> np.ndarray:
    """Training losses of the tiny config at `dtype`: the real train step, task batches and optimizer."""
    c = load_tiny(data_dir=str(data_dir), workdir="unused", max_steps=steps)
    c.model.dtype = dtype
    cfg = from_config_dict(c)
    task = LanguageModelling(cfg, load_dataset(data_dir))
    tx = make_optimizer(cfg.optim)
    params = init_params(task.model_cfg, jax.random.key(cfg.seed))
    state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}
    step_fn = jax.jit(make_train_step(task.loss, tx))
    losses = []
    for i in range(steps):
        batch = jax.tree.map(lambda rows: rows[None], task.train_rows(i, 0, 1))  # one micro-batch
        state, metrics = step_fn(state, batch, jax.random.key(0))
        losses.append(float(metrics["loss"]))
    return np.array(losses)


def test_bf16_loss_curve_tracks_float32(data_dir):
    """30 steps of the tiny config: bf16 compute (float32 parameters and Adam state) stays within the
    tolerance benchmarks/bench_bf16_curves.py applies to the quick start (running means within 2%, and the
    final losses); its docstring says why single steps are not compared."""
    f32, bf16 = _loss_curve(data_dir, "float32", 30), _loss_curve(data_dir, "bfloat16", 30)
    assert f32[-5:].mean() < f32[0] - 0.5  # it learns, so agreement is not two flat lines
    window = np.ones(5) / 5
    smooth_f32, smooth_bf16 = np.convolve(f32, window, "valid"), np.convolve(bf16, window, "valid")
    assert (np.abs(smooth_bf16 - smooth_f32) / smooth_f32).max() <= 0.02
    assert abs(bf16[-5:].mean() - f32[-5:].mean()) <= 0.02 * f32[-5:].mean()


def test_bias_gradient_is_the_sum_over_rows():
    """`add_bias`'s gradients: the cotangent itself for y, and for the bias its float32 sum over every row,
    rounded once to bf16 (plain broadcasting's bf16 sum may round at every addition)."""
    if jax.default_backend() != "cpu":
        pytest.skip("a CPU-only rewrite")
    keys = jax.random.split(jax.random.key(0), 3)
    y = jax.random.normal(keys[0], (4, 64, 3, 8)).astype(jnp.bfloat16)
    bias = jax.random.normal(keys[1], (3, 8)).astype(jnp.bfloat16)
    cotangent = jax.random.normal(keys[2], y.shape).astype(jnp.bfloat16)
    value, dy, dbias = jax.jit(lambda *a: _value_and_grads(lambda a, b, _: add_bias(a, b), None, *a))(
        y, bias, cotangent)
    np.testing.assert_array_equal(np.asarray(value, np.float32), np.asarray(y + bias, np.float32))
    np.testing.assert_array_equal(np.asarray(dy, np.float32), np.asarray(cotangent, np.float32))
    exact = np.asarray(cotangent, np.float32).sum((0, 1))
    assert dbias.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(dbias, np.float32), exact, rtol=2**-8, atol=1e-6)
