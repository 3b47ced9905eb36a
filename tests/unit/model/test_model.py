"""The Flax GPT family against the independent numpy reference, plus property tests."""

from __future__ import annotations

import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.models import (
    ACROSS_POSITIONS,
    MODERN,
    MODERN_COMBOS,
    TINY,
    assert_matches_reference,
    jit_apply,
    modern,
    sample_inputs,
    shrink,
    to_jax,
)
from reference import numpy_reference as ref

from jaxgpt.errors import UserError
from jaxgpt.model.config import RUNTIME_FIELDS, ModelConfig, Seq2SeqConfig
from jaxgpt.model.gpt import GPT, abstract_variables, init_params, stack_layers, unstack_layers
from jaxgpt.model.layers import MLP, Norm
from jaxgpt.model.presets import PRESETS, get_preset
from jaxgpt.ops import activation as activation_op
from jaxgpt.ops.attention import attend, query_blocks
from jaxgpt.tools.summary import count_params, param_shapes, summary

SEED_PRESETS = ["seed000", "seed001", "seed002", "seed004", "gpt2", "gpt2-medium"]


@pytest.mark.accelerator
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name", SEED_PRESETS)
def test_presets_match_reference(name: str, padded: bool) -> None:
    assert_matches_reference(shrink(get_preset(name)), seed=1, padded=padded)


@pytest.mark.accelerator
@pytest.mark.parametrize("name", ["seed000", "seed001", "gpt2"])
def test_query_blocked_attention_matches_reference(name: str) -> None:
    """At 128 tokens the einsum path splits the queries into causal blocks (the tiny configs use one)."""
    cfg = shrink(get_preset(name)).replace(block_size=128)
    assert len(query_blocks(128, 128, causal=True)) == 2
    assert_matches_reference(cfg, seed=5, padded=True)


@pytest.mark.accelerator
@pytest.mark.parametrize(("padded", "K"), [(False, 2), (True, 2), (True, 1)])
def test_blocked_attention_gradients_equal_dense_attention(padded: bool, K: int) -> None:
    """The einsum path's hand-written backward (per query block, `ops.attention._blocked`) against autodiff
    of one dense masked softmax over all keys, at 256 tokens (four blocks), with and without padding, and with
    K = 1 key/value head for the H = 2 query heads (against keys and values repeated to H heads)."""
    B, T, H, D = 2, 256, 2, 8
    kq, kk, kv, kc = jax.random.split(jax.random.key(3), 4)
    q, cot = jax.random.normal(kq, (B, T, H, D)), jax.random.normal(kc, (B, H, T, D))
    k, v = jax.random.normal(kk, (B, K, T, D)), jax.random.normal(kv, (B, K, T, D))
    visible = jnp.tril(jnp.ones((T, T), bool))[None]
    if padded:  # the second row's first 40 tokens are padding: no query attends to them
        visible = visible & (jnp.arange(T)[None, None, :] >= jnp.array([0, 40])[:, None, None])
        cot = cot * visible.any(-1)[:, None, :, None]  # a query that sees no key has no defined output

    def blocked(q, k, v):
        return attend(q, k, v, visible, impl="einsum", dtype="float32", causal=True)[0].transpose(0, 2, 1, 3)

    def dense(q, k, v):
        k, v = jnp.repeat(k, H // K, axis=1), jnp.repeat(v, H // K, axis=1)
        att = jnp.einsum("bthd,bhsd->bhts", q, k) / np.sqrt(D)
        return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(jnp.where(visible[:, None], att, -1e30), -1), v)

    assert len(query_blocks(T, T, causal=True)) == 4
    outs = [jax.jit(jax.value_and_grad(lambda *a, f=f: jnp.sum(f(*a) * cot), argnums=(0, 1, 2)))(q, k, v)
            for f in (blocked, dense)]
    for got, want in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1]), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * float(jnp.abs(want).max()))


def test_query_blocks_tile_the_causal_triangle() -> None:
    for T in (1, 16, 100, 128, 256, 1000, 1024, 4096):
        blocks = query_blocks(T, T, causal=True)
        assert [b[0] for b in blocks] == [0] + [b[1] for b in blocks[:-1]] and blocks[-1][1] == T
        assert all(s1 == t1 for _, t1, s1 in blocks) or blocks == ((0, T, T),)
    assert query_blocks(256, 256, causal=False) == ((0, 256, 256),)


def random_config(rng: np.random.Generator) -> ModelConfig:
    """One point of the knob space that changes the math (dropout is off: the reference is deterministic)."""
    n_head = int(rng.choice([1, 2, 4]))
    n_embd = int(rng.choice([16, 24, 32]))
    if n_embd % n_head:
        n_head = 2
    pad_positions = bool(rng.random() < 0.3)
    return ModelConfig(
        vocab_size=int(rng.integers(20, 80)), block_size=int(rng.integers(4, 13)), n_layer=int(rng.integers(1, 4)),
        n_head=n_head, n_embd=n_embd, head_dim=int(rng.choice([n_embd // n_head, 8, 12])),
        d_ff=int(rng.choice([16, 40, 64])),
        position=str(rng.choice(["learned", "sinusoidal", "sinusoidal_concat", "none"])),
        pad_positions=pad_positions, pad_id=0 if pad_positions or rng.random() < 0.3 else None,
        scale_embeddings=bool(rng.random() < 0.5), norm_placement=str(rng.choice(["pre", "post"])),
        final_norm=bool(rng.random() < 0.6), norm=str(rng.choice(["layernorm", "unbiased_std"])),
        norm_eps=float(rng.choice([1e-6, 1e-5, 1e-3])), activation=str(rng.choice(["relu", "gelu", "gelu_tanh"])),
        use_bias=bool(rng.random() < 0.7), tie_embeddings=bool(rng.random() < 0.5),
        attention_impl=str(rng.choice(["einsum", "einsum", "xla"])), scan_layers=bool(rng.random() < 0.3),
    )


@pytest.mark.parametrize("case", range(50))
def test_random_knob_sweep_matches_reference(case: int) -> None:
    cfg = random_config(np.random.default_rng(1000 + case))
    assert_matches_reference(cfg, seed=case, padded=case % 2 == 1)


def test_classifier_matches_reference() -> None:
    cfg = shrink(get_preset("seed001"))
    params64 = ref.random_params(cfg.to_dict(), seed=3, n_classes=3, std=0.3)
    idx, mask = sample_inputs(cfg, 3, padded=True)
    idx[:, 9] = 7  # the classification token; row 0 has two, the last one counts
    idx[0, 11] = 7
    mask[:, [9, 11]] = True
    (lm, cls), _ = jit_apply(cfg, classifier=True)(to_jax(params64), jnp.asarray(idx), jnp.asarray(mask))
    want_lm, want_cls = ref.classifier_forward(params64, idx, cfg.to_dict(), cls_token_id=7, mask=mask)
    np.testing.assert_allclose(np.asarray(lm), want_lm, atol=1e-5 * np.abs(want_lm).max())
    np.testing.assert_allclose(np.asarray(cls), want_cls, atol=1e-5 * max(1, np.abs(want_cls).max()))


@pytest.mark.parametrize("name", ["seed000", "seed001", "seed004", "gpt2"])
@pytest.mark.parametrize("scan", [False, True])
def test_init_layout_matches_reference_layout(name: str, scan: bool) -> None:
    cfg = shrink(get_preset(name)).replace(scan_layers=scan)
    params = init_params(cfg, jax.random.key(0))
    if scan:
        assert params["h"]["attn"]["qkv"]["kernel"].shape == (cfg.n_layer, 32, 3, 4, cfg.head_dim)
        params = unstack_layers(params, cfg.n_layer)
    want = jax.tree.map(np.shape, ref.random_params(cfg.to_dict()))
    assert jax.tree.map(np.shape, params) == want


def test_gpt2_124m_parameter_count_and_summary() -> None:
    assert count_params(param_shapes(PRESETS["gpt2"])) == 124_439_808
    table = summary(PRESETS["gpt2"])
    assert "124,439,808" in table and "h_11/attn" in table


def test_xavier_init_bounds_are_per_projection() -> None:
    cfg = shrink(get_preset("seed000"))
    params = init_params(cfg, jax.random.key(0))
    qkv = params["h_0"]["attn"]["qkv"]["kernel"]  # three (C, H*D) projections
    bound = np.sqrt(6.0 / (cfg.n_embd + cfg.n_head * cfg.head_dim))
    assert np.abs(qkv).max() <= bound and np.abs(qkv).max() > 0.9 * bound
    assert np.all(init_params(cfg.replace(init="xavier"), jax.random.key(0))["h_0"]["attn"]["qkv"]["bias"] == 0)


def test_gpt2_init_scales_residual_projections() -> None:
    cfg = shrink(get_preset("gpt2")).replace(n_layer=8, n_embd=64, d_ff=256)
    params = init_params(cfg, jax.random.key(0))
    std_fc = float(np.std(params["h_0"]["mlp"]["fc"]["kernel"]))
    std_proj = float(np.std(params["h_0"]["mlp"]["proj"]["kernel"]))
    assert abs(std_fc - 0.02) < 0.002 and abs(std_proj - 0.02 / 4) < 0.0008


# ---- properties --------------------------------------------------------------------------------------------


def test_causality_through_gradients() -> None:
    """d logits[t] / d (embedding of a later token) is exactly zero, and nonzero for earlier ones."""
    cfg = ModelConfig(**TINY, tie_embeddings=False)
    params = init_params(cfg, jax.random.key(0))
    idx = jnp.asarray(np.random.default_rng(0).permutation(cfg.vocab_size)[: cfg.block_size][None])
    t = 9

    def out_at_t(wte, wpe):
        p = {**params, "wte": {"embedding": wte}, "wpe": {"embedding": wpe}}
        return GPT(cfg).apply({"params": p}, idx)[0, t].sum()

    g_wte, g_wpe = jax.grad(out_at_t, argnums=(0, 1))(params["wte"]["embedding"], params["wpe"]["embedding"])
    row_norm = np.abs(np.asarray(g_wte)[np.asarray(idx[0])]).sum(-1)
    assert np.all(row_norm[t + 1:] == 0) and np.all(row_norm[: t + 1] > 0)
    pos_norm = np.abs(np.asarray(g_wpe)).sum(-1)
    assert np.all(pos_norm[t + 1:] == 0) and np.all(pos_norm[: t + 1] > 0)


@pytest.mark.parametrize("name", ["gpt2", "rotary-qk-norm-scaled", "nanochat-gqa-scan-xla", "gemma3-like"])
def test_packed_documents_do_not_see_each_other(name: str) -> None:
    """Two documents packed in a row (segments 1 and 2, then padding 0): the next-token loss of either has exactly
    zero gradient w.r.t. every other token's input embedding (an untied table, each token once), and its logits
    are those of the document alone in a row, so positions restart (a learned table, or rotary under a scaled
    QK-norm, where absolute positions matter); the XLA path takes the mask, and scanned layers the positions (Gemma's
    windowed and global layers too, with their own rotary frequencies)."""
    cfg = (shrink(get_preset("gpt2")) if name == "gpt2" else modern(name)).replace(tie_embeddings=False, block_size=16)
    params = to_jax(ref.random_params(cfg.to_dict(), seed=5, std=0.3))
    params = stack_layers(params, cfg.n_layer) if cfg.scan_layers else params
    T = cfg.block_size
    idx_BT = jnp.asarray(np.random.default_rng(5).permutation(cfg.vocab_size)[:2 * T].reshape(2, T))
    segments_BT = jnp.asarray([[1] * 6 + [2] * 7 + [0] * (T - 13), [1] * T])
    apply = jax.jit(lambda wte, idx, seg: GPT(cfg).apply({"params": {**params, "wte": {"embedding": wte}}}, idx,
                                                         segments_BT=seg))
    wte = params["wte"]["embedding"]
    packed_BTV = apply(wte, idx_BT, segments_BT)
    for doc in (slice(0, 6), slice(6, 13)):
        alone_BTV = apply(wte, idx_BT[:, doc], None)
        np.testing.assert_allclose(np.asarray(packed_BTV[0, doc]), np.asarray(alone_BTV[0]), rtol=0, atol=2e-5)

        def doc_loss(table: jax.Array, doc: slice = doc) -> jax.Array:
            logp_TV = jax.nn.log_softmax(apply(table, idx_BT, segments_BT)[0, doc.start:doc.stop - 1])
            return -jnp.sum(jnp.take_along_axis(logp_TV, idx_BT[0, doc.start + 1:doc.stop, None], -1))

        row_norm = np.abs(np.asarray(jax.grad(doc_loss)(wte))).sum(-1)
        inside = np.zeros(cfg.vocab_size, bool)
        inside[np.asarray(idx_BT[0, doc])] = True
        assert np.all(row_norm[~inside] == 0)  # the other document, the padding, the other row, unused tokens
        assert np.all(row_norm[np.asarray(idx_BT[0, doc.start:doc.stop - 1])] > 0)  # the last token feeds no target


def test_segments_on_splash_are_a_user_error() -> None:
    model = GPT(ModelConfig(**TINY, attention_impl="splash"))
    idx_BT = jnp.zeros((2, TINY["block_size"]), jnp.int32)
    with pytest.raises(UserError, match="splash sees padding"):
        jax.eval_shape(lambda: model.init(jax.random.key(0), idx_BT, segments_BT=jnp.ones_like(idx_BT)))


def test_a_one_row_batch_keeps_its_mask_on_the_xla_path() -> None:
    """A batch of one row with left padding or packed documents: XLA's attention reads its one mask row as given
    (the plain causal triangle is one mask row for a batch of several), so it computes what the einsum path does."""
    cfg = ModelConfig(**TINY)
    T = cfg.block_size
    idx_1T = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (1, T)))
    params = GPT(cfg).init(jax.random.key(3), idx_1T)["params"]
    real_1T = jnp.arange(T)[None] >= 5  # five padding tokens first
    segments_1T = jnp.asarray([[1] * 7 + [2] * (T - 7)])
    for inputs in ({"mask_BT": real_1T}, {"segments_BT": segments_1T}):
        want, got = (GPT(cfg.replace(attention_impl=impl)).apply({"params": params}, idx_1T, **inputs)
                     for impl in ("einsum", "xla"))
        keep = slice(5, None) if "mask_BT" in inputs else slice(None)  # outputs at padding are not defined alike
        np.testing.assert_allclose(np.asarray(got[0, keep]), np.asarray(want[0, keep]), rtol=0, atol=2e-5)


def _loss_and_grad(cfg: ModelConfig, params: dict, idx: jax.Array):
    def loss(p):
        logits = GPT(cfg).apply({"params": p}, idx[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), idx[:, 1:, None], -1))

    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.jax_release
def test_scanned_equals_unrolled() -> None:
    cfg = ModelConfig(**TINY)
    params = init_params(cfg, jax.random.key(0))
    idx = jax.random.randint(jax.random.key(1), (2, 17), 0, cfg.vocab_size)
    scfg = cfg.replace(scan_layers=True)
    l1, g1 = _loss_and_grad(cfg, params, idx)
    l2, g2 = _loss_and_grad(scfg, stack_layers(params, cfg.n_layer), idx)
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), g1, unstack_layers(g2, cfg.n_layer))


@pytest.mark.jax_release
@pytest.mark.parametrize("remat", ["full", "save_dots"])
@pytest.mark.parametrize("scan", [False, True])
def test_remat_equals_no_remat(remat: str, scan: bool) -> None:
    cfg = ModelConfig(**TINY, scan_layers=scan)
    params = init_params(cfg, jax.random.key(0))
    idx = jax.random.randint(jax.random.key(1), (2, 17), 0, cfg.vocab_size)
    l1, g1 = _loss_and_grad(cfg, params, idx)
    l2, g2 = _loss_and_grad(cfg.replace(remat=remat), params, idx)
    assert float(l1) == pytest.approx(float(l2), rel=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), g1, g2)


@pytest.mark.jax_release
@pytest.mark.parametrize("activation", ["gelu_tanh", "gelu", "relu2"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_on_gpus_the_mlp_keeps_its_activations_input_and_output_alone(activation: str, dtype: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """What a feed-forward layer's backward pass keeps of its forward at the hidden width F, as a GPU's program
    has it (`ops.activation`): the activation's input and output (the second product's input), in the model's
    dtype; its float32 intermediates are recomputed (kept, a bf16 GELU's were five more arrays of 4 bytes an
    element). The layer's output and gradients are those of the plain activation, to the bit."""
    cfg = ModelConfig(**TINY, activation=activation, dtype=dtype)
    mlp = MLP(cfg)
    x_BTC = jax.random.normal(jax.random.key(0), (2, 5, cfg.n_embd), dtype)
    variables = mlp.init(jax.random.key(1), x_BTC, True)
    run = lambda: jax.vjp(lambda v, x: mlp.apply(v, x, True), variables, x_BTC)
    y_plain, backward_plain = run()
    monkeypatch.setattr(activation_op, "on_gpu", lambda: True)
    y, backward = run()
    wide = [r.dtype for r in jax.tree.leaves(backward) if r.size == 2 * 5 * cfg.d_ff]
    assert wide == [jnp.dtype(dtype)] * 2
    np.testing.assert_array_equal(y, y_plain)
    for a, b in zip(jax.tree.leaves(backward(y)), jax.tree.leaves(backward_plain(y)), strict=True):
        np.testing.assert_array_equal(a, b)


DROPOUT = dict(embd_dropout=0.1, attn_dropout=0.1, resid_dropout=0.1, ff_dropout=0.1)


@pytest.mark.parametrize("scan", [False, True])
def test_dropout_off_is_deterministic_and_on_follows_only_the_rng(scan: bool) -> None:
    cfg = ModelConfig(**TINY, **DROPOUT, scan_layers=scan)
    params = init_params(cfg, jax.random.key(0))
    model = GPT(cfg)
    a = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
    b = jax.random.randint(jax.random.key(2), (2, 16), 0, cfg.vocab_size)
    run = jax.jit(lambda idx, key: model.apply({"params": params}, idx, deterministic=False, rngs={"dropout": key}))
    k1, k2 = jax.random.key(10), jax.random.key(11)
    off = jax.jit(lambda idx: model.apply({"params": params}, idx))
    np.testing.assert_array_equal(off(a), off(a))
    first = run(a, k1)
    assert not np.allclose(first, off(a))  # dropout is really on
    assert not np.allclose(first, run(a, k2))  # ... and varies with the key
    run(b, k1), run(b, k2)  # other batches in between change nothing: there is no hidden RNG state
    np.testing.assert_array_equal(first, run(a, k1))


@pytest.mark.parametrize(
    "knobs",
    [
        dict(norm="layernorm", activation="gelu_tanh", position="learned"),
        dict(norm="unbiased_std", activation="relu", position="sinusoidal", scale_embeddings=True),
        dict(norm="layernorm", activation="gelu", position="sinusoidal_concat", norm_placement="post",
             final_norm=False),
        dict(norm="unbiased_std", activation="gelu", position="none", tie_embeddings=False),
        dict(position="learned", pad_positions=True, pad_id=0, norm_placement="post", head_dim=12),
        # soft-capped scores take autodiff's backward; with a window, a query scale, Gemma's norms (issue 62)
        dict(position="none", rope_theta=100.0, norm="rmsnorm", norm_scale_offset=1.0, sandwich_norm=True,
             attn_softcap=1.0, query_scale=0.5, sliding_window=3),
    ],
)
def test_gradients_match_float64_finite_differences(knobs: dict) -> None:
    """Directional derivatives of the loss, one direction per parameter tensor, against central differences."""
    cfg = ModelConfig(**{**TINY, "n_layer": 1, "block_size": 8, **knobs})
    params64 = ref.random_params(cfg.to_dict(), seed=5, std=0.2)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, size=(2, cfg.block_size + 1))
    _, grads = _loss_and_grad(cfg, to_jax(params64), jnp.asarray(tokens))
    flat_g, _ = jax.tree.flatten(grads)
    flat_p, treedef = jax.tree.flatten(params64)
    eps = 1e-5
    for i, (p, g) in enumerate(zip(flat_p, flat_g, strict=True)):
        d = rng.normal(size=p.shape)
        shifted = [[q + s * eps * d if j == i else q for j, q in enumerate(flat_p)] for s in (1, -1)]
        plus, minus = (ref.loss(jax.tree.unflatten(treedef, leaves), tokens[:, :-1], tokens[:, 1:], cfg.to_dict())
                       for leaves in shifted)
        fd = (plus - minus) / (2 * eps)
        got = float(np.sum(np.asarray(g, np.float64) * d))
        assert abs(got - fd) <= 1e-4 * max(1.0, abs(fd)), (jax.tree_util.keystr(jax.tree.leaves_with_path(
            grads)[i][0]), got, fd)


@pytest.mark.jax_release
def test_bf16_compute_stays_close_to_float32() -> None:
    cfg = ModelConfig(**TINY)
    params = init_params(cfg, jax.random.key(0))
    idx = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
    full = GPT(cfg).apply({"params": params}, idx)
    half = GPT(cfg.replace(dtype="bfloat16")).apply({"params": params}, idx)
    assert half.dtype == jnp.float32
    np.testing.assert_allclose(half, full, atol=0.05 * float(jnp.abs(full).max()))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(n_embd=30, n_head=4), "not divisible"),
        (dict(activation="swish"), "activation"),
        (dict(resid_dropout=1.0), "[0, 1)"),
        (dict(position="rotary"), "position"),
        (dict(n_layer=0), "positive integer"),
        (dict(attention_impl="xla", attn_dropout=0.1), "attn_dropout"),
        (dict(pad_id=1000), "pad_id"),
        # the open-weight knobs (issue 62)
        (dict(qkv_bias=1), "model.qkv_bias=1 must be True, False or None"),
        (dict(qk_norm_site="after"), "model.qk_norm_site='after' is unknown"),
        (dict(sandwich_norm=True, norm_placement="post"), "sandwich_norm needs model.norm_placement='pre'"),
        (dict(attn_softcap=0.0), "model.attn_softcap=0.0 must be positive"),
        (dict(query_scale=-1.0), "model.query_scale=-1.0 must be positive"),
        (dict(sliding_window=0), "model.sliding_window=0 must be a positive integer"),
        (dict(window_pattern=6), "model.window_pattern needs model.sliding_window"),
        (dict(sliding_window=8, rope_local_theta=1e4), "rope_local_theta=10000.0 needs rotary positions"),
        (dict(position="none", rope_theta=1e4, rope_scaling="ntk"), "model.rope_scaling='ntk' is unknown"),
        (dict(rope_scaling="linear", rope_factor=2.0), "rope_scaling='linear' needs rotary positions"),
        (dict(position="none", rope_theta=1e4, rope_scaling="linear", rope_factor=0.5), "rope_factor=0.5 must be at"),
        (dict(position="none", rope_theta=1e4, rope_scaling="llama3"), "needs model.rope_original_positions"),
        (dict(position="none", rope_theta=1e4, rope_scaling="llama3", rope_original_positions=64,
              rope_low_freq_factor=4.0), "must satisfy 0 < low < high"),
        (dict(position="none", rope_theta=1e4, rope_scaling="yarn", rope_original_positions=64,
              rope_beta_slow=64.0), "must satisfy 0 < slow <= fast"),
        (dict(attn_softcap=30.0, attention_impl="cudnn"), "attn_softcap with attention_impl='cudnn'"),
        (dict(sliding_window=8, attention_impl="splash"), "sliding_window with attention_impl='splash'"),
    ],
)
def test_config_validation_names_the_problem(changes: dict, message: str) -> None:
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace(")", r"\)")):
        ModelConfig(**changes)


# ---- the 2026 options (issue 37): each alone, nanochat's set, and GQA with rotary under padding ----------------


@pytest.mark.parametrize(("name", "padded"), [(name, False) for name in [*MODERN, *MODERN_COMBOS]]
                         + [(name, True) for name in ACROSS_POSITIONS])
def test_modern_options_match_reference(name: str, padded: bool) -> None:
    assert_matches_reference(modern(name), seed=2, padded=padded)


def test_softcap_bounds_the_logits_and_rotary_sees_only_distances() -> None:
    """Checks that hold whatever the reference says: |logits| < cap, and with rotary (no position table) a
    sequence shifted by a few tokens, seen through a causal mask, gives the same logits at the same tokens."""
    cfg = modern("nanochat")
    params = to_jax(ref.random_params(cfg.to_dict(), seed=4, std=0.3))
    idx = np.random.default_rng(4).integers(1, cfg.vocab_size, size=(1, cfg.block_size))
    logits, _ = jit_apply(cfg)(params, jnp.asarray(idx), jnp.ones(idx.shape, bool))  # one compilation for both
    assert np.abs(np.asarray(logits)).max() < cfg.logit_softcap
    shifted = np.concatenate([idx[:, :3], idx[:, :-3]], axis=1)  # tokens 3.. repeat the row from position 3 on
    mask = np.arange(cfg.block_size)[None] >= 3
    out, _ = jit_apply(cfg)(params, jnp.asarray(shifted), jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(out)[:, 3:], np.asarray(logits)[:, :-3], atol=2e-5)


def test_modern_parameter_trees() -> None:
    """GQA has cross-attention's `q` and `kv` kernels with K heads, parameter-free norms have no entry, and the
    layout is the reference's; default models keep their names (`test_init_layout_...` above). Shapes only."""
    shapes = lambda cfg: jax.tree.map(lambda a: a.shape, nn.unbox(abstract_variables(cfg)["params"]))
    cfg = modern("nanochat-gqa-scan-xla").replace(scan_layers=False, norm_scale=True)
    params = shapes(cfg)
    assert params == jax.tree.map(np.shape, ref.random_params(cfg.to_dict()))
    attn = params["h_0"]["attn"]
    assert attn["kv"]["kernel"] == (32, 2, 2, cfg.head_dim) and attn["q_norm"]["scale"] == (8,)
    free = shapes(modern("nanochat"))
    assert sorted(free) == ["h_0", "h_1", "lm_head", "wte"] and sorted(free["h_0"]) == ["attn", "mlp"]


def test_open_weight_parameter_trees_and_identity_norms() -> None:
    """The families' trees are the reference's: Qwen2's biases on q/k/v alone, OLMo 2's (H, D) and (K, D) QK-norm
    scales, Gemma's sandwich norms, whose stored w (scale offset 1) starts at 0, so a fresh model's norms are
    plain RMSNorms, as its (1 + w) applied to a zero w."""
    shapes = lambda cfg: jax.tree.map(lambda a: a.shape, nn.unbox(abstract_variables(cfg)["params"]))
    for name in ("qwen2-like", "olmo-like", "gemma3-like"):
        assert shapes(modern(name)) == jax.tree.map(np.shape, ref.random_params(modern(name).to_dict())), name
    qwen, olmo = shapes(modern("qwen2-like"))["h_0"], shapes(modern("olmo-like"))["h_0"]
    assert sorted(qwen["attn"]["q"]) == ["bias", "kernel"] and sorted(qwen["attn"]["out"]) == ["kernel"]
    assert sorted(qwen["mlp"]["fc"]) == ["kernel"]
    assert (olmo["attn"]["q_norm"]["scale"], olmo["attn"]["k_norm"]["scale"]) == ((4, 8), (2, 8))
    gemma = modern("gemma3-like")
    assert {"ln_1_post", "ln_2_post"} <= set(shapes(gemma)["h_0"])
    x = jax.random.normal(jax.random.key(1), (2, gemma.n_embd))
    scale = nn.unbox(Norm(gemma).init(jax.random.key(0), x))["params"]["scale"]
    assert np.all(np.asarray(scale) == 0)
    np.testing.assert_allclose(Norm(gemma).apply({"params": {"scale": scale}}, x),
                               x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + gemma.norm_eps), rtol=1e-6)


def test_scale_embeddings_multiplies_in_the_activation_dtype() -> None:
    """sqrt(C) is rounded to bf16 first, as Gemma's normalizer tensor of the hidden dtype is (sqrt(640) -> 25.25):
    the product equals bf16 arithmetic, not float32's product rounded once."""
    cfg = ModelConfig(**{**TINY, "n_embd": 640, "n_head": 10}, position="none", scale_embeddings=True,
                      dtype="bfloat16")
    table = np.random.default_rng(0).normal(size=(cfg.vocab_size, cfg.n_embd)).astype(np.float32)
    idx = jnp.arange(8)[None]
    got = GPT(cfg).apply({"params": {"wte": {"embedding": table}}}, idx, jnp.zeros_like(idx), True,
                         method=lambda m, *a: m._embed(*a))
    rows = jnp.asarray(table[:8], jnp.bfloat16)
    want = rows * jnp.asarray(math.sqrt(640), jnp.bfloat16)
    assert got.dtype == jnp.bfloat16 and float(jnp.asarray(math.sqrt(640), jnp.bfloat16)) == 25.25
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want, np.float32))
    once = (jnp.asarray(rows, jnp.float32) * math.sqrt(640)).astype(jnp.bfloat16)
    assert np.any(np.asarray(once, np.float32) != np.asarray(want, np.float32))


def test_zero_init_proj_zeroes_only_the_residual_projections() -> None:
    cfg = shrink(get_preset("gpt2")).replace(zero_init_proj=True, n_layer=1)
    layer = init_params(cfg, jax.random.key(0))["h_0"]
    assert not layer["attn"]["out"]["kernel"].any() and not layer["mlp"]["proj"]["kernel"].any()
    assert layer["attn"]["qkv"]["kernel"].all() and layer["mlp"]["fc"]["kernel"].all()
    assert "zero_init_proj" in RUNTIME_FIELDS  # it changes no shape or meaning: fine-tuning may set it either way


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(n_head=4, n_kv_head=3), "model.n_head=4 is not a multiple of model.n_kv_head=3"),
        (dict(n_kv_head=0), "model.n_kv_head=0 must be a positive integer"),
        (dict(position="none", head_dim=7, rope_theta=1e4), "model.rope_theta needs an even model.head_dim"),
        (dict(rope_theta=1e4), "model.rope_theta=10000.0 with model.position='learned'"),
        (dict(position="none", rope_theta=-1.0), "model.rope_theta=-1.0 must be positive"),
        (dict(logit_softcap=0.0), "model.logit_softcap=0.0 must be positive"),
        (dict(logit_softcap=-15.0), "model.logit_softcap=-15.0 must be positive"),
        (dict(norm="rms"), "model.norm='rms' is unknown"),
        (dict(qk_norm=1), "model.qk_norm=1 must be True or False"),
    ],
)
def test_modern_config_errors_name_the_keys(changes: dict, message: str) -> None:
    with pytest.raises(UserError, match=re.escape(message)):
        ModelConfig(**changes)


def test_modern_config_defaults_and_derived_kv_heads() -> None:
    cfg = ModelConfig(n_head=4, n_embd=32)
    assert (cfg.n_kv_head, cfg.rope_theta, cfg.logit_softcap, cfg.rotary) == (4, None, None, False)
    assert cfg.replace(n_head=8).n_kv_head == 8  # derived: follows n_head, like head_dim
    assert cfg.replace(position="none", rope_theta=0).rope_theta is None  # 0 is "off" too, stored as None
    with pytest.raises(UserError, match="rope_theta=None"):
        Seq2SeqConfig(model=cfg.replace(position="none", rope_theta=1e4))
    nanochat = get_preset("nanochat-d12")
    assert (nanochat.head_dim, nanochat.n_kv_head, nanochat.d_ff) == (128, 6, 3072)
