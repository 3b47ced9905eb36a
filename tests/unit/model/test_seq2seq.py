"""The Flax encoder-decoder against the independent numpy reference, its presets' sizes, and property tests."""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from reference import numpy_reference_seq2seq as ref2

from jaxgpt.errors import UserError
from jaxgpt.model.config import ModelConfig, Seq2SeqConfig
from jaxgpt.model.encdec import Seq2SeqModel, abstract_variables, init_params
from jaxgpt.model.presets import SEQ2SEQ_PRESETS, get_seq2seq_preset
from jaxgpt.train import sharding as layout

TINY = dict(vocab_size=29, src_vocab_size=31, block_size=9, src_block_size=11, n_layer=2, n_encoder_layer=2,
            n_embd=16, n_head=2, d_ff=24)


def shrink(cfg: Seq2SeqConfig, **changes) -> Seq2SeqConfig:
    """A preset at test size, keeping every architectural choice (including head_dim = n_embd)."""
    head_dim = TINY["n_embd"] if cfg.model.head_dim == cfg.model.n_embd else None
    shared = changes.get("share_embeddings", cfg.share_embeddings)
    src_vocab = changes.get("vocab_size", TINY["vocab_size"]) if shared else TINY["src_vocab_size"]
    return cfg.replace(**{**TINY, "src_vocab_size": src_vocab, "head_dim": head_dim, **changes})


def tiny(**changes) -> Seq2SeqConfig:
    return shrink(Seq2SeqConfig(), **changes)


def to_jax(params: dict) -> dict:
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)


@functools.cache
def _apply(cfg: Seq2SeqConfig):
    @jax.jit
    def run(params, src, tgt, src_mask, tgt_mask):
        out, state = Seq2SeqModel(cfg).apply({"params": params}, src, tgt, src_mask, tgt_mask,
                                               mutable=["intermediates"])
        return out, state.get("intermediates", {})

    return run


def sample_batch(cfg: Seq2SeqConfig, seed: int, padded: bool, S: int | None = None) -> dict:
    """Sources (3, S) and targets (3, T); with `padded`, left, right and scattered padding in each.

    Padding is written as pad_id when the config has one, else given as explicit masks (True = real).
    """
    rng = np.random.default_rng(seed)
    S, T = S or cfg.src_block_size, cfg.model.block_size
    src = rng.integers(1, cfg.src_vocab_size, size=(3, S))
    tgt = rng.integers(1, cfg.model.vocab_size, size=(3, T))
    batch = {"src": src, "tgt": tgt, "src_mask": None, "tgt_mask": None}
    if not padded:
        return batch
    src_real, tgt_real = np.ones(src.shape, bool), np.ones(tgt.shape, bool)
    src_real[0, -4:] = tgt_real[0, -3:] = False  # right padding
    src_real[1, :3] = tgt_real[1, :2] = False  # left padding
    src_real[2] = rng.random(S) > 0.4
    src_real[2, 0] = True  # every source keeps a real token
    tgt_real[2] = rng.random(T) > 0.4
    if cfg.model.pad_id is None:
        return {**batch, "src_mask": src_real, "tgt_mask": tgt_real}
    return {**batch, "src": np.where(src_real, src, cfg.model.pad_id), "tgt": np.where(tgt_real, tgt, cfg.model.pad_id)}


def assert_matches_reference(cfg: Seq2SeqConfig, seed: int, padded: bool, S: int | None = None) -> None:
    params64 = ref2.random_params(cfg.to_dict(), seed=seed, std=0.3)
    b = sample_batch(cfg, seed, padded, S)
    as_jax = lambda a: None if a is None else jnp.asarray(a)
    logits, inter = _apply(cfg)(to_jax(params64), *(as_jax(b[k]) for k in ("src", "tgt", "src_mask", "tgt_mask")))
    want, want_probs = ref2.forward(params64, b["src"], b["tgt"], cfg.to_dict(), b["src_mask"], b["tgt_mask"])
    np.testing.assert_allclose(np.asarray(logits), want, rtol=0, atol=1e-5 * max(1.0, np.abs(want).max()))
    if cfg.model.attention_impl != "einsum":
        return
    got = {"encoder": [inter[f"enc_{i}"]["attn"]["attn_weights"][0] for i in range(cfg.n_encoder_layer)],
           "self": [inter[f"dec_{i}"]["attn"]["attn_weights"][0] for i in range(cfg.model.n_layer)],
           "cross": [inter[f"dec_{i}"]["cross"]["attn_weights"][0] for i in range(cfg.model.n_layer)]}
    for kind, layers in want_probs.items():
        for got_l, want_l in zip(got[kind], layers, strict=True):
            np.testing.assert_allclose(np.asarray(got_l), want_l, rtol=0, atol=1e-5, err_msg=kind)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name", sorted(SEQ2SEQ_PRESETS))
def test_presets_match_reference(name: str, padded: bool) -> None:
    assert_matches_reference(shrink(get_seq2seq_preset(name)), seed=1, padded=padded)


KNOBS = [
    # learned positions, one shared table for source, target and output head, explicit padding masks
    dict(position="learned", share_embeddings=True, tie_embeddings=True, activation="gelu", norm_placement="pre"),
    # post-norm with a final norm, no biases, XLA's attention, head_dim unrelated to n_embd / n_head
    dict(norm_placement="post", use_bias=False, attention_impl="xla", head_dim=12, pad_id=0, n_encoder_layer=1,
         n_layer=3),
    # seed 000's norm and interleaved positions without a final norm, untied head, no positions in the encoder
    dict(norm="unbiased_std", norm_eps=1e-6, position="sinusoidal", final_norm=False, tie_embeddings=False,
         scale_embeddings=True, pad_id=0),
    dict(position="none", activation="relu", pad_id=3, tie_embeddings=False, init="xavier"),
]


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("knobs", range(len(KNOBS)))
def test_knobs_match_reference(knobs: int, padded: bool) -> None:
    assert_matches_reference(tiny(**KNOBS[knobs]), seed=knobs + 7, padded=padded)


def test_long_source_is_not_causally_blocked() -> None:
    """At 128 source tokens a causal einsum attention would skip the upper triangle: the encoder must not."""
    cfg = tiny(src_block_size=128, pad_id=0)
    assert_matches_reference(cfg, seed=3, padded=True, S=128)


def _loss_and_grad(cfg: Seq2SeqConfig, params: dict, src: jax.Array, tgt: jax.Array):
    def loss(p):
        logits = Seq2SeqModel(cfg).apply({"params": p}, src, tgt[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tgt[:, 1:, None], -1))

    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize("name", sorted(SEQ2SEQ_PRESETS))
def test_gradients_match_float64_finite_differences(name: str) -> None:
    """Directional derivatives of the loss (one direction per parameter tensor) against central differences.

    seed002-encdec is post-norm, seed000-encdec pre-norm; both with source and target padding (pad id 0).
    """
    cfg = shrink(get_seq2seq_preset(name), n_layer=1, n_encoder_layer=1, pad_id=0, block_size=6, src_block_size=7)
    params64 = ref2.random_params(cfg.to_dict(), seed=5, std=0.2)
    b = sample_batch(cfg.replace(block_size=7), seed=2, padded=True)
    src, tgt = b["src"], b["tgt"]
    _, grads = _loss_and_grad(cfg, to_jax(params64), jnp.asarray(src), jnp.asarray(tgt))
    flat_g = jax.tree.leaves(grads)
    flat_p, treedef = jax.tree.flatten(params64)
    rng, eps = np.random.default_rng(0), 1e-5
    for i, (p, g) in enumerate(zip(flat_p, flat_g, strict=True)):
        d = rng.normal(size=p.shape)
        plus, minus = (ref2.loss(jax.tree.unflatten(treedef, [q + s * eps * d if j == i else q
                                                            for j, q in enumerate(flat_p)]),
                                 src, tgt[:, :-1], tgt[:, 1:], cfg.to_dict()) for s in (1, -1))
        fd = (plus - minus) / (2 * eps)
        got = float(np.sum(np.asarray(g, np.float64) * d))
        assert abs(got - fd) <= 1e-4 * max(1.0, abs(fd)), (jax.tree_util.keystr(
            jax.tree.leaves_with_path(grads)[i][0]), got, fd)


def test_dependencies_through_gradients() -> None:
    """With one token table for both sides, gradients per table row show what each output reads.

    Source ids 1..6 (then two padding zeros), target ids 20..28, one target padding zero at position 3.
    The encoder output reads no target token; decoder position t reads targets <= t and every real source
    token, never a later target and never padding (row 0).
    """
    cfg = tiny(vocab_size=40, share_embeddings=True, tie_embeddings=False, pad_id=0, block_size=9, src_block_size=8,
               position="sinusoidal", n_layer=1, n_encoder_layer=1)
    params = init_params(cfg, jax.random.key(0))
    src = jnp.asarray([[1, 2, 3, 4, 5, 6, 0, 0]])
    tgt = jnp.asarray([[20, 21, 22, 0, 24, 25, 26, 27, 28]])
    weights = jax.random.normal(jax.random.key(1), (1, 8, cfg.model.n_embd))
    memory_module = "enc_ln_f"
    t = 6

    def outputs(wte):
        p = {**params, "wte": {"embedding": wte}}
        logits, state = Seq2SeqModel(cfg).apply({"params": p}, src, tgt, capture_intermediates=True,
                                                  mutable=["intermediates"])
        memory = state["intermediates"][memory_module]["__call__"][0]
        return jnp.sum(memory * weights), logits[0, t].sum()

    wte = params["wte"]["embedding"]
    row = lambda g: np.abs(np.asarray(g)).sum(-1)
    g_memory, g_logits = map(row, jax.jit(jax.jacrev(outputs))(wte))
    assert np.all(g_memory[20:29] == 0) and np.all(g_memory[1:7] > 0)
    assert np.all(g_logits[1:7] > 0) and g_logits[0] == 0
    assert np.all(g_logits[[20, 21, 22, 24, 25, 26]] > 0) and np.all(g_logits[[27, 28]] == 0)


# ---- presets' sizes, layout, sharding ------------------------------------------------------------------------


def param_shapes(cfg: Seq2SeqConfig) -> dict[str, tuple[int, ...]]:
    abstract = nn.unbox(abstract_variables(cfg)["params"])
    return {"/".join(k): tuple(v.shape) for k, v in traverse_util.flatten_dict(abstract).items()}


def count(shapes: dict[str, tuple[int, ...]], *prefixes: str) -> int:
    return sum(math.prod(s) for k, s in shapes.items() if not prefixes or k.startswith(prefixes))


def test_seed002_parameter_count_equals_its_keras_summary() -> None:
    """Seed 002's summary: encoder 64,067,584, decoder 114,482,176, output Dense 1,050,624; 179,600,384 in all."""
    shapes = param_shapes(SEQ2SEQ_PRESETS["seed002-encdec"])
    assert count(shapes, "src_wte", "enc_") == 64_067_584
    assert count(shapes, "wte", "dec_") == 114_482_176
    assert count(shapes, "lm_head") == 1_050_624
    assert count(shapes) == 179_600_384


def test_annotated_transformer_parameter_count() -> None:
    """The Annotated Transformer's make_model(50257, 50257) (6 + 6 layers, 512 wide, d_ff 2048, 8 heads).

    Attention 4 x (512 x 512 + 512) = 1,050,624; feed-forward 2,099,712; a norm 1,024.
    Encoder layer 1,050,624 + 2,099,712 + 2 x 1,024 = 3,152,384; decoder layer 2 x 1,050,624 + 2,099,712 +
    3 x 1,024 = 4,204,032; six of each plus the two final norms = 44,140,544. Source and target embeddings
    2 x 50,257 x 512 = 51,463,168, Generator 512 x 50,257 + 50,257 = 25,781,841: 121,385,553 in all.
    The paper's sharing (one 37,000-token table for source, target and the pre-softmax projection) leaves
    44,140,544 + 37,000 x 512 = 63,084,544 (the paper rounds its base model to 65M).
    """
    cfg = SEQ2SEQ_PRESETS["seed000-encdec"]
    shapes = param_shapes(cfg)
    assert count(shapes, "enc_") == 6 * 3_152_384 + 1_024  # the layers and the final norm, enc_ln_f
    assert count(shapes, "dec_", "ln_f") == 6 * 4_204_032 + 1_024
    assert count(shapes) == 121_385_553
    shared = cfg.replace(vocab_size=37000, src_vocab_size=37000, share_embeddings=True, tie_embeddings=True)
    assert count(param_shapes(shared)) == 63_084_544


@pytest.mark.parametrize("name", sorted(SEQ2SEQ_PRESETS))
def test_init_layout_matches_reference_layout(name: str) -> None:
    cfg = shrink(get_seq2seq_preset(name))
    want = jax.tree.map(np.shape, ref2.random_params(cfg.to_dict()))
    assert jax.tree.map(lambda a: tuple(a.shape), nn.unbox(abstract_variables(cfg)["params"])) == want


@pytest.mark.parametrize("name", sorted(SEQ2SEQ_PRESETS))
def test_every_parameter_has_logical_axis_names(name: str) -> None:
    """Each axis of each parameter is named (fused q/k/v or k/v axes excepted) by a name the rules table knows."""
    specs = traverse_util.flatten_dict(nn.get_partition_spec(abstract_variables(SEQ2SEQ_PRESETS[name]))["params"])
    shapes = traverse_util.flatten_dict(nn.unbox(abstract_variables(SEQ2SEQ_PRESETS[name])["params"]))
    known = {rule for rule, _ in layout.LOGICAL_RULES}
    for path, spec in specs.items():
        assert len(spec) == len(shapes[path].shape), path
        names = [n for n in spec if n is not None]
        assert names and set(names) <= known, (path, spec)
        assert len(names) == len(spec) - (path[-2] in ("qkv", "kv") and path[-1] in ("kernel", "bias")), (path, spec)


def test_runs_sharded_under_the_logical_rules() -> None:
    """Parameters placed by their logical names on a mesh, activations constrained by theirs: same logits."""
    cfg = tiny(pad_id=0, n_layer=1, n_encoder_layer=1)
    params = init_params(cfg, jax.random.key(0))
    b = sample_batch(cfg, seed=0, padded=True)
    want = jax.jit(Seq2SeqModel(cfg).apply)({"params": params}, b["src"], b["tgt"])
    mesh = layout.make_mesh((1, 1, -1))
    with jax.set_mesh(mesh), nn.logical_axis_rules(layout.LOGICAL_RULES):
        shardings = layout.logical_to_sharding(nn.get_partition_spec(abstract_variables(cfg))["params"], mesh)
        placed = jax.device_put(params, shardings)
        got = jax.jit(lambda p, s, t: Seq2SeqModel(cfg).apply({"params": p}, s, t))(placed, b["src"], b["tgt"])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


# ---- dropout, errors ----------------------------------------------------------------------------------------


def test_dropout_follows_only_the_rng() -> None:
    cfg = tiny(embd_dropout=0.1, attn_dropout=0.1, resid_dropout=0.1, ff_dropout=0.1, n_layer=1, n_encoder_layer=1)
    params = init_params(cfg, jax.random.key(0))
    b = sample_batch(cfg, seed=0, padded=False)
    run = jax.jit(lambda key: Seq2SeqModel(cfg).apply({"params": params}, b["src"], b["tgt"], deterministic=False,
                                                        rngs={"dropout": key}))
    off = jax.jit(Seq2SeqModel(cfg).apply)({"params": params}, b["src"], b["tgt"])
    first = run(jax.random.key(1))
    assert not np.allclose(first, off) and not np.allclose(first, run(jax.random.key(2)))
    np.testing.assert_array_equal(first, run(jax.random.key(1)))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(n_encoder_layer=0), "n_encoder_layer"),
        (dict(share_embeddings=True, src_vocab_size=30), "share_embeddings"),
        (dict(pad_id=35), "pad_id"),
        (dict(scan_layers=True), "scan_layers"),
        (dict(remat="full"), "remat"),
    ],
)
def test_config_validation_names_the_problem(changes: dict, message: str) -> None:
    with pytest.raises(UserError, match=message):
        Seq2SeqConfig(ModelConfig(vocab_size=40), src_vocab_size=31).replace(**changes)


def test_too_long_a_source_is_a_user_error() -> None:
    cfg = tiny()
    src = jnp.ones((1, cfg.src_block_size + 1), jnp.int32)
    with pytest.raises(UserError, match="src_block_size"):
        Seq2SeqModel(cfg).init(jax.random.key(0), src, jnp.ones((1, 2), jnp.int32))
