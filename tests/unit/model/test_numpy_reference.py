"""Self-tests for tests/reference/numpy_reference.py.

Why: the reference is the oracle for the Flax model, so it must itself be trustworthy.  These tests
check structural properties (normalised, causal, padding-aware attention), hand-computed tiny cases
for every norm and position kind, and a slow loop-based re-derivation of attention.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from reference import numpy_reference as ref


def make_cfg(**overrides: Any) -> dict[str, Any]:
    """A tiny but fully featured config; individual tests override what they exercise."""
    cfg: dict[str, Any] = {
        "vocab_size": 11,
        "block_size": 8,
        "n_layer": 2,
        "n_head": 2,
        "n_embd": 6,
        "head_dim": 3,
        "d_ff": 10,
        "position": "learned",
        "pad_positions": False,
        "scale_embeddings": False,
        "norm_placement": "pre",
        "final_norm": True,
        "norm": "layernorm",
        "norm_eps": 1e-5,
        "activation": "gelu",
        "use_bias": True,
        "tie_embeddings": False,
        "pad_id": None,
        "dropout": 0.1,  # ignored by the reference
    }
    cfg.update(overrides)
    return cfg


def sample_tokens(
    cfg: dict[str, Any], batch: int = 3, seq_len: int | None = None, seed: int = 1
) -> np.ndarray:
    """Random token ids in range, avoiding pad_id so padding only appears where a test puts it."""
    rng = np.random.default_rng(seed)
    seq_len = cfg["block_size"] if seq_len is None else seq_len
    tokens = rng.integers(0, cfg["vocab_size"], size=(batch, seq_len))
    if cfg["pad_id"] is not None:
        tokens = np.where(tokens == cfg["pad_id"], (cfg["pad_id"] + 1) % cfg["vocab_size"], tokens)
    return tokens


ALL_VARIANTS = [
    make_cfg(),
    make_cfg(norm_placement="post", final_norm=False, activation="relu"),
    make_cfg(norm="unbiased_std", norm_eps=1e-6, position="sinusoidal", scale_embeddings=True),
    make_cfg(position="sinusoidal_concat", activation="gelu_tanh", use_bias=False),
    make_cfg(position="none", tie_embeddings=True, head_dim=5, n_head=3),
    make_cfg(pad_positions=True, pad_id=0, norm_placement="post", tie_embeddings=True),
]


# ----------------------------------------------------------------------------------------------------
# Attention properties
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", ALL_VARIANTS)
def test_forward_shapes_and_dtype(cfg: dict[str, Any]) -> None:
    params = ref.random_params(cfg)
    tokens = sample_tokens(cfg)
    logits, atts, h = ref.forward(params, tokens, cfg)
    batch, seq_len = tokens.shape
    assert logits.shape == (batch, seq_len, cfg["vocab_size"])
    assert h.shape == (batch, seq_len, cfg["n_embd"])
    assert len(atts) == cfg["n_layer"]
    for att in atts:
        assert att.shape == (batch, cfg["n_head"], seq_len, seq_len)
    assert logits.dtype == np.float64 and h.dtype == np.float64
    assert np.all(np.isfinite(logits))


@pytest.mark.parametrize("cfg", ALL_VARIANTS)
def test_attention_rows_sum_to_one_and_upper_triangle_is_zero(cfg: dict[str, Any]) -> None:
    params = ref.random_params(cfg)
    _, atts, _ = ref.forward(params, sample_tokens(cfg), cfg)
    seq_len = cfg["block_size"]
    upper = np.triu(np.ones((seq_len, seq_len), dtype=bool), k=1)
    for att in atts:
        np.testing.assert_allclose(att.sum(axis=-1), 1.0, atol=1e-12)
        assert np.all(att >= 0.0)
        assert np.all(att[..., upper] == 0.0)


def test_first_query_attends_only_to_itself() -> None:
    cfg = make_cfg()
    _, atts, _ = ref.forward(ref.random_params(cfg), sample_tokens(cfg), cfg)
    for att in atts:
        np.testing.assert_array_equal(att[:, :, 0, 0], 1.0)


def test_visibility_rule() -> None:
    # Row 0 is left-padded (first two tokens padding), row 1 has a hole in the middle.
    is_pad = np.array([[True, True, False, False], [False, False, True, False]])
    vis = ref.attention_visibility(is_pad)
    expected_row0 = np.array(
        [
            [1, 0, 0, 0],
            [0, 1, 0, 0],  # padded query whose only earlier key is padding: diagonal only
            [0, 0, 1, 0],
            [0, 0, 1, 1],
        ],
        dtype=bool,
    )
    expected_row1 = np.array(
        [
            [1, 0, 0, 0],
            [1, 1, 0, 0],
            [1, 1, 1, 0],  # a padding query still sees real past keys and itself
            [1, 1, 0, 1],  # padding key 2 hidden from later queries
        ],
        dtype=bool,
    )
    np.testing.assert_array_equal(vis[0], expected_row0)
    np.testing.assert_array_equal(vis[1], expected_row1)


def test_padding_keys_receive_zero_weight_except_on_diagonal() -> None:
    cfg = make_cfg(pad_id=0)
    tokens = sample_tokens(cfg, batch=2, seq_len=6)
    tokens[0, :2] = 0  # left padding
    tokens[1, 3] = 0  # padding in the middle
    _, atts, _ = ref.forward(ref.random_params(cfg), tokens, cfg)
    for att in atts:
        np.testing.assert_array_equal(att[0, :, 1, :], np.eye(6)[1][None].repeat(cfg["n_head"], axis=0))
        np.testing.assert_array_equal(att[0, :, 2:, :2], 0.0)
        np.testing.assert_array_equal(att[1, :, 4:, 3], 0.0)
        assert np.all(att[1, :, 3, 3] > 0.0)
        np.testing.assert_allclose(att.sum(axis=-1), 1.0, atol=1e-12)


def test_mask_and_pad_id_are_equivalent_and_combine_with_or() -> None:
    cfg_id = make_cfg(pad_id=0, pad_positions=True)
    cfg_mask = make_cfg(pad_id=None, pad_positions=True)
    params = ref.random_params(cfg_id)
    tokens = sample_tokens(cfg_id, batch=2, seq_len=5)
    tokens[0, :2] = 0
    tokens[1, 4] = 0
    mask = tokens != 0
    by_id = ref.forward(params, tokens, cfg_id)
    by_mask = ref.forward(params, tokens, cfg_mask, mask=mask)
    np.testing.assert_allclose(by_id[0], by_mask[0], rtol=1e-12, atol=1e-12)
    # Both sources together: mask hides position 2 of row 1 in addition to the pad_id tokens.
    extra = mask.copy()
    extra[1, 2] = False
    both = ref.padding_mask(tokens, cfg_id, extra)
    np.testing.assert_array_equal(both, ~extra)


def slow_attention(x: np.ndarray, p: dict, is_pad: np.ndarray, head_dim: int, use_bias: bool) -> np.ndarray:
    """Attention re-derived with explicit Python loops, as an independent check of the einsums."""
    batch, seq_len, _ = x.shape
    _, _, n_head, _ = p["qkv"]["kernel"].shape
    out = np.zeros_like(x)
    for b in range(batch):
        for h in range(n_head):
            proj = [x[b] @ p["qkv"]["kernel"][:, s, h, :] for s in range(3)]
            if use_bias:
                proj = [proj[s] + p["qkv"]["bias"][s, h] for s in range(3)]
            q, k, v = proj
            for i in range(seq_len):
                allowed = [j for j in range(i + 1) if j == i or not is_pad[b, j]]
                scores = np.array([q[i] @ k[j] / math.sqrt(head_dim) for j in allowed])
                weights = np.exp(scores - scores.max())
                weights /= weights.sum()
                head_out = sum(w * v[j] for w, j in zip(weights, allowed, strict=True))
                out[b, i] += head_out @ p["out"]["kernel"][h]
    if use_bias:
        out += p["out"]["bias"]
    return out


@pytest.mark.parametrize("use_bias", [True, False])
def test_attention_matches_loop_implementation(use_bias: bool) -> None:
    cfg = make_cfg(use_bias=use_bias, n_head=3, head_dim=4)
    p = ref.random_params(cfg)["h_0"]["attn"]
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 5, cfg["n_embd"]))
    is_pad = np.array([[True, False, False, True, False], [False, False, False, False, False]])
    fast, _ = ref.attention(x, p, ref.attention_visibility(is_pad), cfg)
    slow = slow_attention(x, p, is_pad, cfg["head_dim"], use_bias)
    np.testing.assert_allclose(fast, slow, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cfg", ALL_VARIANTS)
def test_causality_future_tokens_do_not_change_the_past(cfg: dict[str, Any]) -> None:
    params = ref.random_params(cfg)
    tokens = sample_tokens(cfg)
    changed = tokens.copy()
    changed[:, 5:] = (changed[:, 5:] + 3) % cfg["vocab_size"]
    if cfg["pad_id"] is not None:
        changed = np.where(changed == cfg["pad_id"], cfg["pad_id"] + 1, changed)
    before, _, _ = ref.forward(params, tokens, cfg)
    after, _, _ = ref.forward(params, changed, cfg)
    np.testing.assert_allclose(before[:, :5], after[:, :5], rtol=1e-12, atol=1e-12)
    assert not np.allclose(before[:, 5:], after[:, 5:])


def test_prefix_consistency() -> None:
    cfg = make_cfg()
    params = ref.random_params(cfg)
    tokens = sample_tokens(cfg)
    full, _, _ = ref.forward(params, tokens, cfg)
    prefix, _, _ = ref.forward(params, tokens[:, :4], cfg)
    np.testing.assert_allclose(full[:, :4], prefix, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------------------
# Norms: hand-computed
# ----------------------------------------------------------------------------------------------------


def test_layernorm_hand_computed() -> None:
    cfg = make_cfg(norm="layernorm", norm_eps=0.0, n_embd=4)
    x = np.array([[[1.0, 2.0, 3.0, 4.0]]])
    # mean 2.5, biased variance 1.25
    p = {"scale": np.array([1.0, 2.0, 1.0, 1.0]), "bias": np.array([0.0, 0.0, 0.0, 10.0])}
    s = math.sqrt(1.25)
    expected = np.array([-1.5 / s, 2 * -0.5 / s, 0.5 / s, 1.5 / s + 10.0])
    np.testing.assert_allclose(ref.norm(x, p, cfg)[0, 0], expected, rtol=1e-14)


def test_layernorm_eps_goes_inside_sqrt() -> None:
    cfg = make_cfg(norm="layernorm", norm_eps=0.75, n_embd=4, use_bias=False)
    x = np.array([[[1.0, 2.0, 3.0, 4.0]]])
    p = {"scale": np.ones(4), "bias": np.full(4, 99.0)}  # bias must be ignored when use_bias=False
    expected = np.array([-1.5, -0.5, 0.5, 1.5]) / math.sqrt(1.25 + 0.75)
    np.testing.assert_allclose(ref.norm(x, p, cfg)[0, 0], expected, rtol=1e-14)


def test_unbiased_std_hand_computed() -> None:
    cfg = make_cfg(norm="unbiased_std", norm_eps=0.5, n_embd=4)
    x = np.array([[[1.0, 2.0, 3.0, 4.0]]])
    # unbiased variance = 5 / 3, eps added to the std
    std = math.sqrt(5.0 / 3.0)
    p = {"scale": np.full(4, 3.0), "bias": np.full(4, -1.0)}
    expected = 3.0 * np.array([-1.5, -0.5, 0.5, 1.5]) / (std + 0.5) - 1.0
    np.testing.assert_allclose(ref.norm(x, p, cfg)[0, 0], expected, rtol=1e-14)


def test_norm_kinds_differ() -> None:
    x = np.random.default_rng(0).normal(size=(1, 2, 6))
    p = {"scale": np.ones(6), "bias": np.zeros(6)}
    a = ref.norm(x, p, make_cfg(norm="layernorm", norm_eps=0.0))
    b = ref.norm(x, p, make_cfg(norm="unbiased_std", norm_eps=0.0))
    np.testing.assert_allclose(a, b * math.sqrt(6 / 5), rtol=1e-12)


# ----------------------------------------------------------------------------------------------------
# Positions: hand-computed
# ----------------------------------------------------------------------------------------------------


def test_sinusoidal_interleaved_hand_computed() -> None:
    table = ref.sinusoidal_table(3, 4, "sinusoidal")
    # frequencies for dim 4: 1 and 10000 ** (-2/4) = 0.01
    expected = np.array(
        [
            [0.0, 1.0, 0.0, 1.0],
            [math.sin(1.0), math.cos(1.0), math.sin(0.01), math.cos(0.01)],
            [math.sin(2.0), math.cos(2.0), math.sin(0.02), math.cos(0.02)],
        ]
    )
    np.testing.assert_allclose(table, expected, rtol=1e-14, atol=1e-15)


def test_sinusoidal_concat_hand_computed() -> None:
    table = ref.sinusoidal_table(3, 4, "sinusoidal_concat")
    expected = np.array(
        [
            [0.0, 0.0, 1.0, 1.0],
            [math.sin(1.0), math.sin(0.01), math.cos(1.0), math.cos(0.01)],
            [math.sin(2.0), math.sin(0.02), math.cos(2.0), math.cos(0.02)],
        ]
    )
    np.testing.assert_allclose(table, expected, rtol=1e-14, atol=1e-15)


def test_sinusoidal_kinds_are_column_permutations_of_each_other() -> None:
    interleaved = ref.sinusoidal_table(50, 16, "sinusoidal")
    concat = ref.sinusoidal_table(50, 16, "sinusoidal_concat")
    np.testing.assert_allclose(concat[:, :8], interleaved[:, 0::2], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(concat[:, 8:], interleaved[:, 1::2], rtol=1e-12, atol=1e-12)


def test_sinusoidal_rejects_odd_dim() -> None:
    with pytest.raises(ValueError):
        ref.sinusoidal_table(4, 5, "sinusoidal")


def _zero_body_cfg(**overrides: Any) -> dict[str, Any]:
    """Config whose embedding output can be read off directly (no layers, no norm, tied output)."""
    return make_cfg(n_layer=0, final_norm=False, tie_embeddings=True, n_embd=4, vocab_size=5, **overrides)


def _embedding_params(cfg: dict[str, Any]) -> dict:
    wte = np.arange(20, dtype=np.float64).reshape(5, 4)
    params: dict[str, Any] = {"wte": {"embedding": wte}}
    if cfg["position"] == "learned":
        rows = ref.position_table_rows(cfg)
        params["wpe"] = {"embedding": 100.0 * np.arange(rows * 4, dtype=np.float64).reshape(rows, 4)}
    return params


def test_learned_positions_hand_computed() -> None:
    cfg = _zero_body_cfg(position="learned")
    params = _embedding_params(cfg)
    tokens = np.array([[3, 1]])
    _, _, h = ref.forward(params, tokens, cfg)
    # wte[3] = [12, 13, 14, 15], wte[1] = [4, 5, 6, 7]; wpe[p] = 100 * [4p, 4p+1, 4p+2, 4p+3]
    expected = np.array([[12.0, 113.0, 214.0, 315.0], [404.0, 505.0, 606.0, 707.0]])
    np.testing.assert_allclose(h[0], expected)


def test_learned_pad_positions_hand_computed() -> None:
    cfg = _zero_body_cfg(position="learned", pad_positions=True, pad_id=0)
    params = _embedding_params(cfg)
    assert params["wpe"]["embedding"].shape == (cfg["block_size"] + 1, 4)
    tokens = np.array([[0, 2, 0, 1]])
    np.testing.assert_array_equal(ref.position_ids(tokens, cfg), [[0, 2, 0, 4]])
    _, _, h = ref.forward(params, tokens, cfg)
    wpe = params["wpe"]["embedding"]
    wte = params["wte"]["embedding"]
    expected = np.stack([wte[0] + wpe[0], wte[2] + wpe[2], wte[0] + wpe[0], wte[1] + wpe[4]])
    np.testing.assert_allclose(h[0], expected)


def test_pad_positions_from_explicit_mask() -> None:
    cfg = make_cfg(pad_positions=True, pad_id=None)
    tokens = np.array([[5, 6, 7]])
    np.testing.assert_array_equal(ref.position_ids(tokens, cfg, np.array([[False, True, True]])), [[0, 2, 3]])
    np.testing.assert_array_equal(ref.position_ids(tokens, make_cfg()), [[0, 1, 2]])


@pytest.mark.parametrize("kind", ["sinusoidal", "sinusoidal_concat"])
def test_sinusoidal_positions_added_to_scaled_embeddings(kind: str) -> None:
    cfg = _zero_body_cfg(position=kind, scale_embeddings=True)
    params = _embedding_params(cfg)
    tokens = np.array([[3, 1, 4]])
    _, _, h = ref.forward(params, tokens, cfg)
    wte = params["wte"]["embedding"]
    if kind == "sinusoidal":
        pe = [[0, 1, 0, 1], [math.sin(1), math.cos(1), math.sin(0.01), math.cos(0.01)]]
        pe.append([math.sin(2), math.cos(2), math.sin(0.02), math.cos(0.02)])
    else:
        pe = [[0, 0, 1, 1], [math.sin(1), math.sin(0.01), math.cos(1), math.cos(0.01)]]
        pe.append([math.sin(2), math.sin(0.02), math.cos(2), math.cos(0.02)])
    expected = 2.0 * wte[[3, 1, 4]] + np.array(pe)  # sqrt(C) = 2
    np.testing.assert_allclose(h[0], expected, rtol=1e-14)


def test_sinusoidal_pad_positions() -> None:
    cfg = _zero_body_cfg(position="sinusoidal", pad_positions=True, pad_id=0)
    params = _embedding_params(cfg)
    tokens = np.array([[0, 2, 3]])
    _, _, h = ref.forward(params, tokens, cfg)
    table = ref.sinusoidal_table(4, 4, "sinusoidal")
    expected = params["wte"]["embedding"][[0, 2, 3]] + table[[0, 2, 3]]
    np.testing.assert_allclose(h[0], expected, rtol=1e-14)


def test_no_positions_hand_computed() -> None:
    cfg = _zero_body_cfg(position="none")
    params = _embedding_params(cfg)
    tokens = np.array([[2, 2]])
    logits, _, h = ref.forward(params, tokens, cfg)
    np.testing.assert_array_equal(h[0], [[8.0, 9.0, 10.0, 11.0]] * 2)
    np.testing.assert_allclose(logits[0, 0], params["wte"]["embedding"] @ np.array([8.0, 9.0, 10.0, 11.0]))


# ----------------------------------------------------------------------------------------------------
# Activations, blocks, heads, losses
# ----------------------------------------------------------------------------------------------------


def test_activations_hand_computed() -> None:
    x = np.array([-1.0, 0.0, 1.0, 2.0])
    np.testing.assert_array_equal(ref.activation(x, "relu"), [0.0, 0.0, 1.0, 2.0])
    phi = np.array([0.15865525393145705, 0.5, 0.8413447460685429, 0.9772498680518208])
    np.testing.assert_allclose(ref.activation(x, "gelu"), x * phi, rtol=1e-14, atol=1e-16)
    approx = np.array([-0.15880800939172324, 0.0, 0.8411919906082768, 1.954597694087775])
    np.testing.assert_allclose(ref.activation(x, "gelu_tanh"), approx, rtol=1e-13)
    with pytest.raises(ValueError):
        ref.activation(x, "swish")


def _silence_sublayers(params: dict, cfg: dict[str, Any]) -> None:
    """Zero every attention / MLP weight so each sub-layer outputs exactly zero."""
    for layer in range(cfg["n_layer"]):
        for group in ("attn", "mlp"):
            for dense in params[f"h_{layer}"][group].values():
                for key in dense:
                    dense[key] = np.zeros_like(dense[key])


def test_pre_norm_block_is_identity_when_sublayers_are_silent() -> None:
    cfg = make_cfg(norm_placement="pre", final_norm=False)
    params = ref.random_params(cfg)
    _silence_sublayers(params, cfg)
    tokens = sample_tokens(cfg)
    _, _, h = ref.forward(params, tokens, cfg)
    np.testing.assert_allclose(h, ref.embed(params, tokens, cfg), rtol=1e-14)


def test_post_norm_block_normalises_residual_sum() -> None:
    cfg = make_cfg(norm_placement="post", final_norm=False, n_layer=1)
    params = ref.random_params(cfg)
    _silence_sublayers(params, cfg)
    tokens = sample_tokens(cfg)
    _, _, h = ref.forward(params, tokens, cfg)
    layer = params["h_0"]
    x = ref.embed(params, tokens, cfg)
    expected = ref.norm(ref.norm(x, layer["ln_1"], cfg), layer["ln_2"], cfg)
    np.testing.assert_allclose(h, expected, rtol=1e-12)


def test_final_norm_applied() -> None:
    cfg = make_cfg(final_norm=True)
    params = ref.random_params(cfg)
    tokens = sample_tokens(cfg)
    _, _, h_with = ref.forward(params, tokens, cfg)
    _, _, h_without = ref.forward(params, tokens, make_cfg(final_norm=False))
    np.testing.assert_allclose(h_with, ref.norm(h_without, params["ln_f"], cfg), rtol=1e-12)


def test_untied_head_and_tied_head() -> None:
    cfg = make_cfg(tie_embeddings=False)
    params = ref.random_params(cfg)
    tokens = sample_tokens(cfg)
    logits, _, h = ref.forward(params, tokens, cfg)
    np.testing.assert_allclose(
        logits, h @ params["lm_head"]["kernel"] + params["lm_head"]["bias"], rtol=1e-12
    )
    tied_cfg = make_cfg(tie_embeddings=True)
    tied_logits, _, tied_h = ref.forward(params, tokens, tied_cfg)
    np.testing.assert_allclose(tied_logits, tied_h @ params["wte"]["embedding"].T, rtol=1e-12)


def _as_float32(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {key: _as_float32(value) for key, value in tree.items()}
    return np.asarray(tree, dtype=np.float32)


def test_float32_params_are_promoted_and_not_mutated() -> None:
    cfg = make_cfg()
    params32 = _as_float32(ref.random_params(cfg))
    snapshot = ref.to_float64(params32)
    tokens = sample_tokens(cfg)
    logits, atts, h = ref.forward(params32, tokens, cfg)
    assert logits.dtype == atts[0].dtype == h.dtype == np.float64
    # Same result as feeding the exactly-promoted float64 tree: no float32 arithmetic anywhere.
    np.testing.assert_array_equal(logits, ref.forward(snapshot, tokens, cfg)[0])
    assert params32["wte"]["embedding"].dtype == np.float32
    np.testing.assert_array_equal(params32["wte"]["embedding"], snapshot["wte"]["embedding"])


@pytest.mark.parametrize("cfg", ALL_VARIANTS)
def test_log_probs_normalise_and_loss_matches_manual(cfg: dict[str, Any]) -> None:
    params = ref.random_params(cfg)
    tokens = sample_tokens(cfg)
    targets = sample_tokens(cfg, seed=7)
    logp = ref.log_probs(params, tokens, cfg)
    np.testing.assert_allclose(np.exp(logp).sum(axis=-1), 1.0, atol=1e-12)
    logits, _, _ = ref.forward(params, tokens, cfg)
    manual = 0.0
    for b in range(tokens.shape[0]):
        for t in range(tokens.shape[1]):
            row = logits[b, t]
            manual += math.log(np.exp(row - row.max()).sum()) + row.max() - row[targets[b, t]]
    manual /= tokens.size
    assert ref.loss(params, tokens, targets, cfg) == pytest.approx(manual, rel=1e-12)


def test_loss_of_uniform_model_is_log_vocab() -> None:
    cfg = make_cfg(tie_embeddings=False)
    params = ref.random_params(cfg)
    params["lm_head"]["kernel"][:] = 0.0
    params["lm_head"]["bias"][:] = 0.0
    tokens = sample_tokens(cfg)
    assert ref.loss(params, tokens, tokens, cfg) == pytest.approx(math.log(cfg["vocab_size"]), rel=1e-14)


def test_classifier_uses_last_cls_position() -> None:
    cfg = make_cfg(n_layer=1, tie_embeddings=True)
    params = ref.random_params(cfg, n_classes=4)
    cls_id = 10
    tokens = np.array([[1, cls_id, 2, 3, cls_id, 5], [cls_id, 4, 4, 4, 4, 4]])
    lm_logits, cls_logits = ref.classifier_forward(params, tokens, cfg, cls_token_id=cls_id)
    logits, _, h = ref.forward(params, tokens, cfg)
    np.testing.assert_allclose(lm_logits, logits, rtol=1e-14)
    head = params["cls_head"]
    expected = np.stack([h[0, 4], h[1, 0]]) @ head["kernel"] + head["bias"]
    np.testing.assert_allclose(cls_logits, expected, rtol=1e-12)
    assert cls_logits.shape == (2, 4)
    with pytest.raises(ValueError):
        ref.classifier_forward(params, np.array([[1, 2, 3]]), cfg, cls_token_id=cls_id)


def test_head_dim_independent_of_width() -> None:
    cfg = make_cfg(n_embd=6, n_head=4, head_dim=7)
    params = ref.random_params(cfg)
    assert params["h_0"]["attn"]["qkv"]["kernel"].shape == (6, 3, 4, 7)
    _, atts, _ = ref.forward(params, sample_tokens(cfg), cfg)
    assert atts[0].shape[1] == 4


def test_rejects_sequences_longer_than_block_size() -> None:
    cfg = make_cfg()
    with pytest.raises(ValueError):
        ref.forward(ref.random_params(cfg), sample_tokens(cfg, seq_len=cfg["block_size"] + 1), cfg)


def test_fully_padded_row_stays_finite() -> None:
    cfg = make_cfg(pad_id=0, pad_positions=True)
    tokens = np.zeros((1, 5), dtype=np.int64)
    logits, atts, _ = ref.forward(ref.random_params(cfg), tokens, cfg)
    assert np.all(np.isfinite(logits))
    for att in atts:
        np.testing.assert_array_equal(att[0], np.broadcast_to(np.eye(5), (cfg["n_head"], 5, 5)))


# ----------------------------------------------------------------------------------------------------
# The 2026 options (issue 37): hand-computed cases and properties
# ----------------------------------------------------------------------------------------------------


def test_rmsnorm_hand_computed_with_and_without_scale() -> None:
    x = np.array([[[1.0, 2.0, 3.0, 4.0]]])  # mean square 7.5
    p = {"scale": np.array([1.0, 2.0, 1.0, 1.0])}
    plain = np.array([1.0, 2.0, 3.0, 4.0]) / math.sqrt(7.5 + 0.5)
    cfg = make_cfg(norm="rmsnorm", norm_eps=0.5, n_embd=4, use_bias=False)
    np.testing.assert_allclose(ref.norm(x, p, cfg)[0, 0], plain * p["scale"], rtol=1e-14)
    np.testing.assert_allclose(ref.norm(x, {}, {**cfg, "norm_scale": False})[0, 0], plain, rtol=1e-14)


def test_rotary_hand_computed_and_relative() -> None:
    """D = 4, base 100: pair (0, 2) turns by t rad, pair (1, 3) by t / 10; scores depend on distance only."""
    x = np.zeros((1, 3, 1, 4))
    x[0, :, 0] = [1.0, 1.0, 0.0, 0.0]
    got = ref.rotary(x, 100.0)[0, :, 0]
    expected = [[math.cos(t), math.cos(t / 10), math.sin(t), math.sin(t / 10)] for t in range(3)]
    np.testing.assert_allclose(got, expected, rtol=1e-14, atol=1e-15)
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(1, 1, 1, 6)), rng.normal(size=(1, 1, 1, 6))
    seq = lambda v, at: np.concatenate([np.zeros((1, at, 1, 6)), v], axis=1)  # v at index `at`
    score = lambda tq, tk: float(ref.rotary(seq(q, tq), 1e4)[0, tq, 0] @ ref.rotary(seq(k, tk), 1e4)[0, tk, 0])
    assert score(5, 2) == pytest.approx(score(3, 0), rel=1e-12) and score(5, 2) != pytest.approx(score(4, 2))


def test_relu2_and_softcap_hand_computed() -> None:
    np.testing.assert_array_equal(ref.activation(np.array([-1.0, 0.0, 0.5, 2.0]), "relu2"), [0.0, 0.0, 0.25, 4.0])
    cfg = make_cfg(tie_embeddings=True, logit_softcap=2.0)
    params = {"wte": {"embedding": np.array([[1.0, 0.0], [0.0, 100.0]])}}
    np.testing.assert_allclose(ref.lm_logits(params, np.array([[[1.0, 1.0]]]), cfg)[0, 0],
                               [2.0 * math.tanh(0.5), 2.0 * math.tanh(50.0)], rtol=1e-14)


def test_grouped_query_attention_is_attention_with_shared_key_value_heads() -> None:
    """K = 1 key/value head for 3 query heads equals multi-head attention whose heads' keys and values are copies,
    with rotary positions and QK-norm, under padding."""
    gqa = make_cfg(n_head=3, head_dim=4, n_kv_head=1, rope_theta=50.0, qk_norm=True, position="none")
    mha = {**gqa, "n_kv_head": 3}
    p = ref.random_params(gqa)["h_0"]["attn"]
    kv = p["kv"]["kernel"]  # (C, 2, 1, D)
    tiled = {"qkv": {"kernel": np.concatenate([p["q"]["kernel"][:, None], np.repeat(kv, 3, axis=2)], axis=1),
                     "bias": np.concatenate([p["q"]["bias"][None], np.repeat(p["kv"]["bias"], 3, axis=1)])},
             **{name: p[name] for name in ("q_norm", "k_norm", "out")}}
    x = np.random.default_rng(3).normal(size=(2, 5, gqa["n_embd"]))
    visible = ref.attention_visibility(np.array([[True, False, False, True, False], [False] * 5]))
    got, got_att = ref.attention(x, p, visible, gqa)
    want, want_att = ref.attention(x, tiled, visible, mha)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got_att, want_att, rtol=1e-12, atol=1e-12)
