"""The seed-exact settings: where each seed applies dropout, how it initializes each module, seed 002's padding.

Dropout sites are checked by recovering which elements a dropout call zeroed; initializations by comparing every
parameter's statistics with the rule each seed's code implies (Xavier, PyTorch's nn.Linear / nn.Embedding
defaults, explicit normal inits), the PyTorch rule itself against torch when it is installed.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from jaxgpt.errors import UserError
from jaxgpt.model import encdec as seq2seq
from jaxgpt.model.config import DROPOUTS, ModelConfig, model_config_from_dict
from jaxgpt.model.gpt import GPT, GPTClassifier, init_params
from jaxgpt.model.layers import sinusoidal_table
from jaxgpt.model.presets import PRESETS, SEQ2SEQ_PRESETS

SMALL = dict(vocab_size=512, block_size=16, n_layer=2, n_embd=64, n_head=4, head_dim=16, d_ff=256)


def small(name: str, **changes) -> ModelConfig:
    return PRESETS[name].replace(**{**SMALL, **changes})


def small_seq2seq(name: str, **changes):
    return SEQ2SEQ_PRESETS[name].replace(**{**SMALL, "n_layer": 1}, n_encoder_layer=1, src_vocab_size=None,
                                         src_block_size=None, **changes)


def test_presets_carry_the_seed_settings() -> None:
    assert (PRESETS["seed000"].init, PRESETS["seed000"].embd_dropout_site) == ("xavier_torch", "sum")
    assert (PRESETS["seed001"].init, PRESETS["seed001"].embd_dropout_site) == ("gpt1_torch", "tokens")
    seed002 = PRESETS["seed002"]
    assert (seed002.pad_id, seed002.attn_resid_dropout, seed002.resid_dropout) == (0, False, 0.1)
    assert SEQ2SEQ_PRESETS["seed002-encdec"].model == seed002
    assert SEQ2SEQ_PRESETS["seed000-encdec"].model.init == "xavier_torch"


def test_checkpoints_without_the_new_fields_load_with_todays_behaviour() -> None:
    old = {k: v for k, v in ModelConfig().to_dict().items() if k not in ("embd_dropout_site", "attn_resid_dropout")}
    cfg = model_config_from_dict(old)
    assert (cfg.embd_dropout_site, cfg.attn_resid_dropout) == ("sum", True)


def test_any_dropout_is_whether_some_rate_is_non_zero() -> None:
    assert not ModelConfig().any_dropout  # every rate 0: training draws no masks
    for name in DROPOUTS:
        assert ModelConfig(**{name: 0.1}).any_dropout, name
    assert not ModelConfig(attn_resid_dropout=False).any_dropout  # a switch, not a rate


@pytest.mark.parametrize(("changes", "message"), [
    (dict(embd_dropout_site="positions"), "model.embd_dropout_site='positions' is unknown"),
    (dict(attn_resid_dropout=0), "model.attn_resid_dropout=0 must be True or False"),
    (dict(init="kaiming"), "model.init='kaiming' is unknown"),
])
def test_bad_settings_are_one_line_user_errors(changes: dict, message: str) -> None:
    with pytest.raises(UserError, match=message.replace("(", r"\(")) as caught:
        ModelConfig(**changes)
    assert "\n" not in str(caught.value)


# ---- dropout sites ---------------------------------------------------------------------------------------------


def embed_with_dropout(cfg: ModelConfig, params: dict, idx_BT: jax.Array, key: jax.Array) -> np.ndarray:
    """GPT's embedding output in training mode, positions 0..T-1."""
    pos_BT = jnp.broadcast_to(jnp.arange(idx_BT.shape[1]), idx_BT.shape)
    return np.asarray(jax.jit(lambda p: GPT(cfg).apply({"params": p}, idx_BT, pos_BT, False, method=GPT._embed,
                                                       rngs={"dropout": key}))(params))


def test_token_site_drops_the_token_embedding_before_positions_are_added() -> None:
    """Seed 001: a dropped element is exactly its position code; the same key drops the same elements as the
    "sum" site, whose dropped elements are 0 (GPT-2, seed 000)."""
    p = 0.5
    cfg = small("seed001", n_layer=1, embd_dropout=p)
    params = init_params(cfg, jax.random.key(0))
    idx_BT = jax.random.randint(jax.random.key(1), (2, 12), 1, cfg.vocab_size)
    tok = np.asarray(params["wte"]["embedding"])[idx_BT]
    pos = np.asarray(params["wpe"]["embedding"])[:12][None]  # the positions passed in
    tokens_out = embed_with_dropout(cfg, params, idx_BT, jax.random.key(2))
    keep_tokens = tokens_out != pos
    np.testing.assert_allclose(tokens_out, np.where(keep_tokens, tok / (1 - p), 0) + pos, rtol=1e-6, atol=1e-6)
    sum_out = embed_with_dropout(cfg.replace(embd_dropout_site="sum"), params, idx_BT, jax.random.key(2))
    keep_sum = sum_out != 0
    np.testing.assert_array_equal(keep_tokens, keep_sum)
    np.testing.assert_allclose(sum_out, np.where(keep_sum, (tok + pos) / (1 - p), 0), rtol=1e-6, atol=1e-6)
    assert abs(keep_sum.mean() - (1 - p)) < 0.05


@pytest.mark.parametrize("site", ["tokens", "sum"])
def test_encoder_decoder_uses_the_same_embedding_dropout_site(site: str) -> None:
    cfg = small_seq2seq("seed002-encdec", embd_dropout=0.5, embd_dropout_site=site)
    model, params = seq2seq.Seq2SeqModel(cfg), seq2seq.init_params(cfg, jax.random.key(0))
    src_BS = jax.random.randint(jax.random.key(1), (2, 10), 1, cfg.src_vocab_size)
    out = np.asarray(jax.jit(lambda p: model.apply({"params": p}, src_BS, method=lambda m, s: m._embed(
        m.src_wte, None, s, jnp.arange(10), cfg.src_block_size, False), rngs={"dropout": jax.random.key(2)}))(params))
    pos = sinusoidal_table(10, cfg.model.n_embd, cfg.model.position)[None]
    dropped = np.isclose(out, pos, atol=1e-6) if site == "tokens" else out == 0
    assert 0.4 < dropped.mean() < 0.6


def zero_sublayer_outputs(params: dict, sublayers: tuple[str, ...]) -> dict:
    """Parameters whose given sub-layers (e.g. "mlp") output exactly zero: their last projection is zeroed."""
    last = {"mlp": "proj", "attn": "out", "cross": "out"}
    flat = traverse_util.flatten_dict(params)
    return traverse_util.unflatten_dict({
        k: jnp.zeros_like(v) if any(k[-3:-1] == (s, last[s]) for s in sublayers) else v for k, v in flat.items()})


@pytest.mark.parametrize("name", ["seed002", "seed000"])  # post-norm and pre-norm blocks
@pytest.mark.parametrize("attn_resid_dropout", [True, False])
def test_attention_residual_dropout_switch(name: str, attn_resid_dropout: bool) -> None:
    """With the feed-forward silenced, resid_dropout has only the attention output left to drop: training-mode
    logits equal the deterministic ones exactly when attn_resid_dropout is off. With attention silenced instead,
    the feed-forward's dropout still acts under both settings."""
    cfg = small(name, n_layer=1, embd_dropout=0.0, attn_dropout=0.0, ff_dropout=0.0, resid_dropout=0.5,
                pad_id=None, attn_resid_dropout=attn_resid_dropout)
    model, params = GPT(cfg), init_params(cfg, jax.random.key(0))
    idx_BT = jax.random.randint(jax.random.key(1), (2, 12), 0, cfg.vocab_size)

    @jax.jit
    def dropout_effect(p: dict) -> jax.Array:
        train = model.apply({"params": p}, idx_BT, deterministic=False, rngs={"dropout": jax.random.key(3)})
        return jnp.abs(train - model.apply({"params": p}, idx_BT)).max()

    assert (dropout_effect(zero_sublayer_outputs(params, ("mlp",))) > 1e-5) == attn_resid_dropout
    assert dropout_effect(zero_sublayer_outputs(params, ("attn",))) > 1e-5


@pytest.mark.parametrize("attn_resid_dropout", [True, False])
def test_encoder_decoder_attention_residual_dropout_switch(attn_resid_dropout: bool) -> None:
    """The same in both stacks: self-attention and cross-attention outputs are dropped only when the switch is on."""
    cfg = small_seq2seq("seed002-encdec", attn_dropout=0.0, resid_dropout=0.5, attn_resid_dropout=attn_resid_dropout)
    model, params = seq2seq.Seq2SeqModel(cfg), seq2seq.init_params(cfg, jax.random.key(0))
    src_BS = jax.random.randint(jax.random.key(1), (2, 9), 1, cfg.src_vocab_size)
    tgt_BT = jax.random.randint(jax.random.key(2), (2, 7), 1, cfg.model.vocab_size)

    @jax.jit
    def dropout_effect(p: dict) -> jax.Array:
        train = model.apply({"params": p}, src_BS, tgt_BT, deterministic=False, rngs={"dropout": jax.random.key(3)})
        return jnp.abs(train - model.apply({"params": p}, src_BS, tgt_BT)).max()

    assert (dropout_effect(zero_sublayer_outputs(params, ("mlp",))) > 1e-5) == attn_resid_dropout


# ---- initializations -------------------------------------------------------------------------------------------


def assert_uniform(a: np.ndarray, bound: float, where: str) -> None:
    n = a.size
    assert np.abs(a).max() <= bound * (1 + 1e-6), where
    assert np.abs(a).max() > bound * (0.8 if n < 100 else 0.97), where
    assert abs(a.std() / (bound / math.sqrt(3)) - 1) < 2.5 / math.sqrt(n), where
    assert abs(a.mean()) < 5 * bound / math.sqrt(3 * n), where


def assert_normal(a: np.ndarray, std: float, where: str) -> None:
    n = a.size
    assert abs(a.std() / std - 1) < 3.5 / math.sqrt(n), where
    assert abs(a.mean()) < 5 * std / math.sqrt(n), where
    if n > 1000:  # tails a uniform of the same std (at most 1.73 std) cannot have
        assert np.abs(a).max() > 3 * std, where


def check_rules(params: dict, rule) -> None:
    """Every parameter against rule(path, shape) -> ("uniform", bound) | ("normal", std) | ("const", value)."""
    for path, value in traverse_util.flatten_dict(params).items():
        where = "/".join(path)
        a = np.asarray(value, np.float64)
        kind, x = rule(path, a.shape)
        if kind == "uniform":
            assert_uniform(a, x, where)
        elif kind == "normal":
            assert_normal(a, x, where)
        else:
            assert np.all(a == x), where


def test_seed000_init_is_xavier_with_pytorch_default_biases() -> None:
    """make_model: xavier_uniform_ on every matrix (each nn.Linear its own (d_model, d_model) matrix), biases left
    at nn.Linear's U(+-1/sqrt(fan_in)), its LayerNorm at 1 and 0."""
    cfg = small("seed000")
    V, C, F = cfg.vocab_size, cfg.n_embd, cfg.d_ff
    xavier = lambda fan_in, fan_out: ("uniform", math.sqrt(6 / (fan_in + fan_out)))
    linear_bias = lambda fan_in: ("uniform", 1 / math.sqrt(fan_in))

    def rule(path: tuple[str, ...], shape: tuple[int, ...]) -> tuple[str, float]:
        module, leaf = path[-2], path[-1]
        if module.startswith("ln"):
            return ("const", 1.0 if leaf == "scale" else 0.0)
        table = {("wte", "embedding"): xavier(V, C), ("lm_head", "kernel"): xavier(C, V),
                 ("lm_head", "bias"): linear_bias(C), ("qkv", "kernel"): xavier(C, C), ("qkv", "bias"): linear_bias(C),
                 ("out", "kernel"): xavier(C, C), ("out", "bias"): linear_bias(C), ("fc", "kernel"): xavier(C, F),
                 ("fc", "bias"): linear_bias(C), ("proj", "kernel"): xavier(F, C), ("proj", "bias"): linear_bias(F)}
        return table[module, leaf]

    check_rules(init_params(cfg, jax.random.key(0)), rule)


def test_seed001_init_follows_its_explicit_inits_and_pytorch_defaults() -> None:
    """normal(0.02) on the token table, the feed-forward weights and the classifier weight; nn.Embedding's N(0, 1)
    positions; nn.Linear defaults U(+-1/sqrt(fan_in)) for the attention projections and every other bias;
    the classifier bias `normal_(bias, 0)`, i.e. N(0, 1)."""
    cfg = small("seed001")
    C, F, n_class = cfg.n_embd, cfg.d_ff, 256
    linear = lambda fan_in: ("uniform", 1 / math.sqrt(fan_in))

    def rule(path: tuple[str, ...], shape: tuple[int, ...]) -> tuple[str, float]:
        module, leaf = path[-2], path[-1]
        if module.startswith("ln"):
            return ("const", 1.0 if leaf == "scale" else 0.0)
        table = {("wte", "embedding"): ("normal", 0.02), ("wpe", "embedding"): ("normal", 1.0),
                 ("qkv", "kernel"): linear(C), ("qkv", "bias"): linear(C), ("out", "kernel"): linear(C),
                 ("out", "bias"): linear(C), ("fc", "kernel"): ("normal", 0.02), ("fc", "bias"): linear(C),
                 ("proj", "kernel"): ("normal", 0.02), ("proj", "bias"): linear(F),
                 ("cls_head", "kernel"): ("normal", 0.02), ("cls_head", "bias"): ("normal", 1.0)}
        return table[module, leaf]

    model = GPTClassifier(cfg, n_class=n_class)
    params = nn.unbox(jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
    assert params["wpe"]["embedding"].shape == (cfg.block_size + 1, C)
    check_rules(params, rule)


def test_encoder_decoder_follows_the_same_init_rule() -> None:
    """The Annotated Transformer's full model: cross-attention and the source table get Xavier too, and
    every projection bias nn.Linear's default."""
    cfg = small_seq2seq("seed000-encdec")
    params = traverse_util.flatten_dict(seq2seq.init_params(cfg, jax.random.key(0)))
    C = cfg.model.n_embd
    assert_uniform(np.asarray(params["src_wte", "embedding"]), math.sqrt(6 / (cfg.src_vocab_size + C)), "src_wte")
    for leaf in ("q", "kv"):
        assert_uniform(np.asarray(params["dec_0", "cross", leaf, "kernel"]), math.sqrt(6 / (2 * C)), leaf)
        assert_uniform(np.asarray(params["dec_0", "cross", leaf, "bias"]), 1 / math.sqrt(C), leaf)


@pytest.mark.torch
def test_pytorch_defaults_are_the_rule_the_tests_assume() -> None:
    """torch's own nn.Linear, nn.Embedding and xavier_uniform_ obey the bounds the tests above check."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 512)
    assert_uniform(linear.weight.detach().numpy(), 1 / 16, "torch Linear weight")
    assert_uniform(linear.bias.detach().numpy(), 1 / 16, "torch Linear bias")
    assert_normal(torch.nn.Embedding(100, 64).weight.detach().numpy(), 1.0, "torch Embedding")
    assert_uniform(torch.nn.init.xavier_uniform_(torch.empty(64, 256)).numpy(), math.sqrt(6 / 320), "xavier")


# ---- seed 002's mask_zero --------------------------------------------------------------------------------------


def test_seed002_padding_never_reaches_real_positions() -> None:
    """Token 0 is padding (Keras' mask_zero): whatever the padding embeds to, the logits at real tokens stay the
    same; an explicit mask hides changed tokens the same way. Without pad_id the same change leaks."""
    cfg = small("seed002")
    params = init_params(cfg, jax.random.key(0))
    idx_BT = jax.random.randint(jax.random.key(1), (2, 12), 1, cfg.vocab_size)
    idx_BT = idx_BT.at[0, 3:5].set(0).at[1, 7].set(0)
    real_BT = np.asarray(idx_BT != 0)
    forward = jax.jit(lambda c, p, idx, mask=None: GPT(c).apply({"params": p}, idx, mask), static_argnums=0)
    logits = np.asarray(forward(cfg, params, idx_BT))
    noisy = jax.tree.map(lambda a: a, params)
    noisy["wte"]["embedding"] = params["wte"]["embedding"].at[0].add(jax.random.normal(jax.random.key(2), (64,)))
    changed = np.asarray(forward(cfg, noisy, idx_BT))
    np.testing.assert_allclose(changed[real_BT], logits[real_BT], atol=1e-5)
    assert not np.allclose(changed[~real_BT], logits[~real_BT], atol=1e-3)

    other_BT = jnp.where(real_BT, idx_BT, 7)  # different tokens at the padded positions, hidden by the mask
    masked = np.asarray(forward(cfg, params, other_BT, jnp.asarray(real_BT)))
    np.testing.assert_allclose(masked[real_BT], logits[real_BT], atol=1e-5)

    unpadded = cfg.replace(pad_id=None)
    leaks = np.asarray(forward(unpadded, noisy, idx_BT))
    assert not np.allclose(leaks[real_BT], np.asarray(forward(unpadded, params, idx_BT))[real_BT], atol=1e-3)
