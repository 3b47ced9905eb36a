"""Splash attention (Pallas interpret mode on the CPU) and the chunked loss against the dense paths, `auto`'s
choice per platform, and a train step exported for CUDA on this GPU-less machine.

Interpret mode runs the TPU kernel's program one tile at a time in Python-driven XLA: exact, slow, so the
shapes stay small (2 rows, up to 3 heads, 384 positions: three 128-tiles, so the causal tile skipping is
exercised).
"""

from __future__ import annotations

import importlib.util
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.attention import outputs_and_grads, qkv, visible_mask

from jaxgpt.model.config import ModelConfig
from jaxgpt.model.gpt import init_params
from jaxgpt.ops import splash
from jaxgpt.ops.attention import Scores, attend, resolve_impl
from jaxgpt.ops.loss import chunked_cross_entropy, token_nll
from jaxgpt.tasks.lm import LanguageModelling
from jaxgpt.train import sharding as layout
from jaxgpt.train.config import base_config, from_config_dict, model_fields
from jaxgpt.train.optim import OptimConfig, make_optimizer
from jaxgpt.train.step import make_train_step

pytestmark = pytest.mark.jax_release


@pytest.mark.parametrize(("H", "T", "padded"), [
    (1, 128, False), (2, 128, True),  # the default run; longer sequences and more heads in the slow one
    pytest.param(3, 384, False, marks=pytest.mark.slow), pytest.param(2, 384, True, marks=pytest.mark.slow)])
def test_splash_equals_einsum_forward_and_gradients(H: int, T: int, padded: bool) -> None:
    B, D = 2, 16
    q, k, v = qkv(B, H, T, D)
    pad = None
    if padded:
        pad = np.zeros((B, T), bool)
        pad[0, :37] = True  # left padding
        pad[1, -150:] = True  # right padding, across a tile boundary
    visible = visible_mask(B, T, pad)
    real_BT = np.ones((B, T), bool) if pad is None else ~pad
    # Padding queries' outputs are not defined alike (see splash.padding_segments): nothing may read them.
    weight = jax.random.normal(jax.random.key(1), (B, T, H, D)) * jnp.asarray(real_BT)[:, :, None, None]
    y_ref, g_ref = outputs_and_grads("einsum", q, k, v, visible, weight)
    y, g = outputs_and_grads("splash", q, k, v, visible, weight)
    np.testing.assert_allclose(np.asarray(y)[real_BT], np.asarray(y_ref)[real_BT], atol=1e-5, rtol=1e-5)
    for name, a, b in zip("qkv", g, g_ref, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5, err_msg=f"d{name}")


def test_splash_under_a_mesh_runs_per_device_with_shard_map() -> None:
    """With a mesh and the logical rules set (as the trainer sets them), splash runs inside shard_map."""
    B, H, T, D = 2, 2, 128, 8
    q, k, v = qkv(B, H, T, D, seed=3)
    visible = visible_mask(B, T, None)
    mesh = layout.make_mesh((-1, 1, 1), jax.devices()[:1])
    with jax.set_mesh(mesh), nn.logical_axis_rules(layout.LOGICAL_RULES):
        f = jax.jit(lambda q, k, v: attend(q, k, v, visible, impl="splash", dtype="float32", causal=True)[0])
        assert "shard_map" in str(jax.make_jaxpr(f)(q, k, v))
        y = f(q, k, v)
    y_ref = attend(q, k, v, visible, impl="einsum", dtype="float32", causal=True)[0]
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), atol=1e-5, rtol=1e-5)


def test_splash_falls_back_where_it_does_not_tile() -> None:
    """A model's one-row init (8 positions) takes the XLA path: same numbers, no kernel."""
    q, k, v = qkv(1, 2, 8, 8)
    visible = visible_mask(1, 8, None)
    assert not splash.splash_fits(1, 2, 8)
    y = attend(q, k, v, visible, impl="splash", dtype="float32", causal=True)[0]
    y_ref = attend(q, k, v, visible, impl="einsum", dtype="float32", causal=True)[0]
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), atol=1e-5, rtol=1e-5)


def test_auto_is_einsum_on_cpu_and_splash_for_a_tpu_mesh() -> None:
    assert resolve_impl("auto", "bfloat16") == "einsum"
    assert resolve_impl("xla", "bfloat16") == "xla"
    assert resolve_impl("auto", "bfloat16", Scores(scale=0.1, softcap=30.0)) == "einsum"
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed: no TPU topology to set as the mesh")
    from jaxgpt.tools import aot

    with jax.set_mesh(layout.make_mesh((-1, 1, 1), aot.topology_devices("v5e:2x2"))):
        assert resolve_impl("auto", "bfloat16") == "splash"
        # splash has no window and no kernel but einsum's soft-caps scores (issue 62)
        assert resolve_impl("auto", "bfloat16", Scores(windowed=True)) == "xla"
        assert resolve_impl("auto", "bfloat16", Scores(softcap=50.0, windowed=True)) == "einsum"


def _task(model: ModelConfig, loss_chunk: int) -> LanguageModelling:
    c = base_config()
    c.workdir, c.model, c.loss_chunk = "unused", model_fields(model), loss_chunk
    return LanguageModelling(from_config_dict(c), None)


@pytest.mark.accelerator
@pytest.mark.parametrize("tied", [True, False])
def test_chunked_loss_equals_the_dense_loss_and_gradients(tied: bool) -> None:
    cfg = ModelConfig(vocab_size=97, block_size=32, n_layer=2, n_head=2, n_embd=32, tie_embeddings=tied)
    params = init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    batch = {k: jnp.asarray(rng.integers(0, cfg.vocab_size, (3, cfg.block_size)), jnp.int32) for k in "xy"}
    grad = lambda task: jax.jit(jax.value_and_grad(lambda p: task.loss(p, batch, jax.random.key(0))[0]))(params)
    (dense, g_dense), (chunked, g_chunked) = grad(_task(cfg, 0)), grad(_task(cfg, 8))
    assert abs(float(dense) - float(chunked)) < 1e-5
    for a, b in zip(jax.tree.leaves(g_chunked), jax.tree.leaves(g_dense), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
    assert float(_task(cfg, 8).evaluate(params, batch)) == pytest.approx(float(dense), abs=1e-5)


def test_token_nll_is_optaxs_cross_entropy_and_its_gradient_scatters_nothing() -> None:
    """`token_nll` equals optax's integer-label cross-entropy to the bit, values and gradients (reverse and
    forward mode), and its gradient has no scatter: the target's logit is gathered, but differentiated as a
    one-hot select that fuses into the softmax's gradient (one pass over the logits, not three). The program is
    read as lowered, before XLA's passes, which may expand a scatter into a loop (jaxlib 0.10's LLVM emitters)."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(3, 7, 97)) * 6, jnp.float32)
    targets = jnp.asarray(rng.integers(0, 97, (3, 7)), jnp.int32)
    weights = jnp.asarray(rng.normal(size=(3, 7)), jnp.float32)
    ours = lambda x: jnp.sum(weights * token_nll(x, targets))
    optaxs = lambda x: jnp.sum(weights * optax.softmax_cross_entropy_with_integer_labels(x, targets))
    np.testing.assert_array_equal(token_nll(logits, targets),
                                  optax.softmax_cross_entropy_with_integer_labels(logits, targets))
    np.testing.assert_array_equal(jax.grad(ours)(logits), jax.grad(optaxs)(logits))
    np.testing.assert_array_equal(jax.jacfwd(ours)(logits), jax.jacfwd(optaxs)(logits))
    scatters = lambda f: re.findall(r"stablehlo\.scatter", jax.jit(jax.grad(f)).lower(logits).as_text())
    assert scatters(optaxs) and not scatters(ours)


@pytest.mark.parametrize("unroll", [True, False])
def test_a_loss_chunk_keeps_its_two_reductions_for_the_backward_and_no_logits(unroll: bool) -> None:
    """What the chunked loss keeps for its backward pass, both layouts: per position the logits' max and sum of
    exponentials (`keep_reductions`), so the backward recomputes the head's product and passes over the logits
    once; never logits themselves (float32 (B, t) pairs per chunk; nothing V wide)."""
    B, T, C, V, chunk = 2, 8, 4, 11, 4
    h_BTC, w_CV = jax.random.normal(jax.random.key(0), (B, T, C)), jax.random.normal(jax.random.key(1), (C, V))
    y_BT = jax.random.randint(jax.random.key(2), (B, T), 0, V)
    _, backward = jax.vjp(lambda h, w: chunked_cross_entropy(lambda x: x @ w, h, y_BT, chunk, unroll=unroll),
                          h_BTC, w_CV)
    kept = [r for r in jax.tree.leaves(backward) if r.dtype == jnp.float32]
    assert sum(r.size for r in kept if r.shape[-2:] == (B, chunk)) == 2 * B * T
    assert not any(r.ndim > 2 and r.shape[-1] == V for r in kept)


def test_chunked_loss_never_holds_all_logits() -> None:
    """No array of the compiled training gradient holds the batch's logits: one chunk's at most."""
    cfg = ModelConfig(vocab_size=4096, block_size=256, n_layer=1, n_head=2, n_embd=32)
    params = init_params(cfg, jax.random.key(0))
    batch = {k: jnp.zeros((4, cfg.block_size), jnp.int32) for k in "xy"}
    texts = {}
    for chunk in (0, 32):
        loss = lambda p, chunk=chunk: _task(cfg, chunk).loss(p, batch, jax.random.key(0))[0]
        texts[chunk] = jax.jit(jax.value_and_grad(loss)).lower(params).compile().as_text()
    whole = ("f32[4,256,4096]", "f32[1024,4096]")
    assert any(shape in texts[0] for shape in whole)
    assert not any(shape in texts[32] for shape in whole) and "f32[4,32,4096]" in texts[32]


def test_a_train_step_exports_for_cuda_without_a_gpu() -> None:
    """jax.export lowers the real train step (XLA attention, chunked loss) for CUDA on this CPU-only host."""
    cfg = ModelConfig(vocab_size=128, block_size=64, n_layer=2, n_head=2, n_embd=32, dtype="bfloat16",
                      attention_impl="xla")
    task, tx = _task(cfg, 16), make_optimizer(OptimConfig(warmup_steps=1, decay_steps=10))
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    state = {"params": params, "opt_state": jax.eval_shape(tx.init, params),
             "step": jax.ShapeDtypeStruct((), jnp.int32)}
    batch = {k: jax.ShapeDtypeStruct((1, 4, cfg.block_size), jnp.int32) for k in "xy"}
    key = jax.eval_shape(lambda: jax.random.key(0))
    exported = jax.export.export(jax.jit(make_train_step(task.loss, tx)), platforms=["cuda"])(state, batch, key)
    assert exported.platforms == ("cuda",)
    text = exported.mlir_module()
    assert "stablehlo.dot_general" in text and "bf16" in text
