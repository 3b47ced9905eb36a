"""The sampler: the cached loop against the no-cache computation of the same rule, the strategies, the CLI."""

from __future__ import annotations

import functools
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import ROOT
from helpers.models import (
    ACROSS_POSITIONS,
    MODERN,
    CountingDecodes,
    bpe_or_skip,
    modern,
    prompts,
    random_params,
    shrink,
)
from reference.sampling_reference import generate_uncached

from jaxgpt.commands import sample as cli
from jaxgpt.data.tokenizer import CharTokenizer, WordTokenizer
from jaxgpt.errors import UserError
from jaxgpt.generate import sampling, strategies
from jaxgpt.generate.sampling import generate, stream
from jaxgpt.generate.strategies import filter_logits, pick_tokens
from jaxgpt.generate.text_stream import StreamDecoder
from jaxgpt.io import weights
from jaxgpt.model.attention import init_cache
from jaxgpt.model.config import ModelConfig
from jaxgpt.model.presets import PRESETS


def assert_same_generation(cfg: ModelConfig, prompt: np.ndarray, **options) -> np.ndarray:
    params = random_params(cfg)
    got, got_logits = generate(params, cfg, prompt, return_logits=True, **options)
    want, want_logits = generate_uncached(params, cfg, prompt, return_logits=True, bucketed=False, **options)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got_logits, want_logits, rtol=0, atol=1e-5 * max(1.0, np.abs(want_logits).max()))
    return got


# Every preset once, and between them every knob the cache interacts with: scanned and unscanned layers
# under both norm placements, all four position kinds (seed 001's padded positions too), tied and untied
# heads, both attention implementations.
def _distinct(configs: list[ModelConfig]) -> list[ModelConfig]:
    return list(dict.fromkeys(configs))


SWEEP = {
    "seed000-scan": shrink(PRESETS["seed000"], scan_layers=True),
    "seed001": shrink(PRESETS["seed001"]),
    "seed002-scan": shrink(PRESETS["seed002"], scan_layers=True),
    "seed004": shrink(PRESETS["seed004"]),
    "gpt2-scan": shrink(PRESETS["gpt2"], scan_layers=True),
    "gpt2-nopos-xla": shrink(PRESETS["gpt2"], position="none", attention_impl="xla"),
    "gpt2-nobias": shrink(PRESETS["gpt2"], use_bias=False),
}
# The GPT-2 family (and the 6.7B shape) differ only in size, so shrunk they are one config: these five
# cover every preset but nanochat's and the open-weight families' (the gated ones), whose architectures
# `test_modern_options_decode_equal_uncached` decodes (nanochat and the family combos of helpers.models).
assert {shrink(c) for c in PRESETS.values() if not c.gated_mlp} == {
    shrink(PRESETS[n]) for n in ("seed000", "seed001", "seed002", "seed004", "gpt2", "nanochat-d12")}


@pytest.mark.accelerator
@pytest.mark.parametrize("name", SWEEP)
def test_cached_equals_uncached_for_short_and_long_prompts(name: str) -> None:
    """Two rows decode with the kernels as declared, one row with output-major ones (on CPUs): both exact."""
    cfg = SWEEP[name]
    for length, batch in ((5, 2), (cfg.block_size + 7, 1)):  # 30 new tokens: the window fills and slides
        assert_same_generation(cfg, prompts(cfg, length, batch), max_new_tokens=30, temperature=0)


@pytest.mark.parametrize("name", [*ACROSS_POSITIONS[:3], "nanochat", "nanochat-gqa-scan-xla", "gemma3-like",
                                  "gemma3-like-scan-remat", "mistral-like-xla", "yarn",
                                  *(pytest.param(n, marks=pytest.mark.slow) for n in MODERN
                                    if n not in ACROSS_POSITIONS[:3])])
def test_modern_options_decode_equal_uncached(name: str) -> None:
    """Each 2026 option alone (two rows, declared kernels), and nanochat's set (one row, output-major kernels on
    CPUs, a prompt past the context so the window slides and the rotary positions restart with it). The options
    that act on each position alone are all in nanochat's set, and multi-query attention is grouped-query
    attention's code with one group; alone they run with the slow tests."""
    cfg = modern(name)
    batch, length = (1, cfg.block_size + 3) if name.startswith(("nanochat", "gemma3-like-scan")) else (2, 5)
    assert_same_generation(cfg, prompts(cfg, length, batch), max_new_tokens=12, temperature=0)


def test_grouped_query_cache_holds_the_key_value_heads() -> None:
    """The cache stores n_kv_head heads, never the keys and values repeated for every query head."""
    for name, heads in (("gqa", 2), ("mqa", 1)):
        cache = init_cache(modern(name), batch_size=3, length=8)
        assert [c["k"].shape for c in cache] == [(3, heads, 8, 8)] * 2
    assert init_cache(modern("nanochat-gqa-scan-xla"), 3, 8)["v"].shape == (2, 3, 2, 8, 8)


FULL_SWEEP = _distinct([shrink(c, scan_layers=scan) for c in PRESETS.values() for scan in (False, True)]
                       + [shrink(PRESETS["gpt2"], position=p, scan_layers=s)
                          for p in ("none", "sinusoidal", "sinusoidal_concat") for s in (False, True)])


@pytest.mark.slow
@pytest.mark.parametrize("cfg", FULL_SWEEP, ids=lambda c: f"{c.position}-{c.norm_placement}-scan{c.scan_layers}")
@pytest.mark.parametrize("shift", [1, 5, 16])
def test_cached_equals_uncached_full_cross_product(cfg: ModelConfig, shift: int) -> None:
    for length in (3, 16, 21):
        assert_same_generation(cfg, prompts(cfg, length), max_new_tokens=40, temperature=0, window_shift=shift)


def test_window_shift_one_is_seed000s_rule() -> None:
    """Shift 1: every token is the argmax given exactly the previous block_size tokens (written out here)."""
    cfg = SWEEP["seed004"]
    S = cfg.block_size
    params, prompt = random_params(cfg), prompts(cfg, S)
    got = assert_same_generation(cfg, prompt, max_new_tokens=30, temperature=0, window_shift=1)
    forward = jax.jit(lambda p, idx: sampling.GPT(cfg).apply({"params": p}, idx)[:, -1])
    seq = prompt
    for _ in range(30):
        seq = np.concatenate([seq, np.argmax(forward(params, jnp.asarray(seq[:, -S:])), -1)[:, None]], axis=1)
    np.testing.assert_array_equal(got, seq[:, S:])


@pytest.mark.slow
@pytest.mark.parametrize("shift", [2, 7, 15, 16])
def test_other_window_shifts_match_uncached(shift: int) -> None:
    """16 = block_size keeps only the newest token after a jump."""
    cfg = SWEEP["seed001"]
    assert_same_generation(cfg, prompts(cfg, 9), max_new_tokens=40, temperature=0, window_shift=shift)


# One set of sampling options (and one model) for every test of sampled generation, the CLI's included:
# they share one compilation.
SAMPLED = dict(max_new_tokens=30, temperature=1.3, top_k=40, top_p=0.97)
SAMPLED_CFG = SWEEP["seed001"]  # pad_id 0: sampling must never produce it


def test_sampled_tokens_match_uncached_and_streaming() -> None:
    """With temperature, top-k and top-p the noise of step i depends only on (seed, i): all paths agree."""
    cfg = SAMPLED_CFG
    got = generate(random_params(cfg), cfg, prompts(cfg, 5), key=7, **SAMPLED)
    want = generate_uncached(random_params(cfg), cfg, prompts(cfg, 5), key=7, **SAMPLED)  # bucketed windows
    np.testing.assert_array_equal(got, want)
    chunks = list(stream(random_params(cfg), cfg, prompts(cfg, 5), chunk_size=7, key=7, **SAMPLED))
    assert [c.shape[1] for c in chunks] == [7, 7, 7, 7, 2]
    np.testing.assert_array_equal(np.concatenate(chunks, axis=1), got)


def test_reproducible_per_seed_and_different_across_seeds() -> None:
    cfg = SAMPLED_CFG
    params, prompt = random_params(cfg), prompts(cfg, 5)
    run = lambda key: generate(params, cfg, prompt, key=key, **SAMPLED)
    np.testing.assert_array_equal(run(1), run(1))
    np.testing.assert_array_equal(run(1), run(jax.random.key(1)))
    assert not np.array_equal(run(1), run(2))


def test_padding_id_is_never_sampled() -> None:
    cfg = SAMPLED_CFG
    hot = dict(SAMPLED, temperature=100.0)  # nearly uniform over the top 40: 0 would come up often
    tokens = generate(random_params(cfg), cfg, prompts(cfg, 5), key=0, **hot)
    assert cfg.pad_id == 0 and not (tokens == 0).any() and len(np.unique(tokens)) > 30


def test_repeated_calls_reuse_the_compiled_loop() -> None:
    cfg = SAMPLED_CFG
    params = random_params(cfg)
    generate(params, cfg, prompts(cfg, 5), key=0, **SAMPLED)
    before = sampling._run._cache_size(), sampling._prefill._cache_size()
    for t, p, seed in ((0.9, 0.5, 2), (1.7, 0.95, 3)):  # new values, same shapes and options: no compilation
        generate(params, cfg, prompts(cfg, 5, seed=seed), key=seed, **dict(SAMPLED, temperature=t, top_p=p))
    assert (sampling._run._cache_size(), sampling._prefill._cache_size()) == before


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_loop_updates_the_cache_in_place(dtype: str) -> None:
    """No while-loop body of the compiled generation copies a layer's (B, H, S, D) cache, whole or sliced.

    A copy per layer and token is invisible to every equality test but was a third of the larger
    benchmark model's decode time (and a slice of a stacked cache, 30% of the small one's); this reads
    XLA's optimized program to keep them out. A bf16 model keeps a float32 cache on CPUs
    (`attention.work_dtype`): no bf16 image of the cache is made per token either.
    """
    cfg = SWEEP["seed001"]
    params, cfg = sampling.decoding_weights(random_params(cfg), cfg, dtype, output_major=False)
    state = sampling._prefill(params, jnp.asarray(prompts(cfg, 3)), jax.random.key(0), cfg=cfg, output_major=False)
    spec = sampling.SamplerSpec(greedy=True, top_k=None, use_top_p=False, eot_token=None, window_shift=8)
    hlo = sampling._run.lower(params, state, jnp.int32(40), jnp.float32(1), jnp.float32(1), cfg=cfg,
                              spec=spec, num_steps=40).compile().as_text()
    assert state.cache[0]["k"].dtype == jnp.float32
    cache_shape = "f32[{},{},{},{}]".format(*state.cache[0]["k"].shape)
    bodies = {}
    for name in re.findall(r"while\(.*?body=%([\w.]+)", hlo):
        text = hlo[hlo.index(f"\n%{name} ") :]
        bodies[name] = text[: text.index("\n}\n")]
    assert any(" dot(" in text for text in bodies.values()), "the model should run inside a while loop"
    for name, text in bodies.items():
        copies = re.findall(re.escape(cache_shape) + r"\{[0-9,]*\} copy\(", text)
        slices = re.findall(r"%slice[\w.-]* = " + re.escape(cache_shape), text)
        assert not copies and not slices, f"{len(copies)} cache copies, {len(slices)} slices in the loop body {name}"
        assert cache_shape.replace("f32", "bf16") not in text, f"a bf16 image of the cache in the loop body {name}"


def test_batch_one_decode_loop_reads_output_major_kernels_as_stored() -> None:
    """One row on a CPU: every projection reads its (outputs, inputs) matrix in place, on every token, and the
    tied head the token table.

    A transpose between the stored matrix and its product (undoing the layout inside the program) is
    copied or fused into a slower loop on every token by XLA:CPU; no computation of the decode loop (its
    bodies and the fusions they call) may make an array of any kernel's or the table's shape, in either order.
    """
    cfg = SWEEP["seed001"]
    raw = random_params(cfg)
    req = sampling.request(cfg, prompts(cfg, 3, batch=1), num_samples=None, max_new_tokens=40, temperature=0,
                           top_k=None, top_p=None, key=0, eot_token=None, window_shift=8, return_logits=False,
                           vocab_limit=None)
    spec = req.spec
    assert spec.output_major, "one row on a CPU"
    params, dcfg = sampling.decoding_weights(raw, cfg, None, output_major=True)
    assert params["h_0"]["mlp"]["fc"]["kernel"].shape == raw["h_0"]["mlp"]["fc"]["kernel"].shape[::-1]
    state = sampling._prefill(params, jnp.asarray(req.prompt_BT), req.key, cfg=dcfg, output_major=True)
    hlo = sampling._run.lower(params, state, jnp.int32(40), jnp.float32(1), jnp.float32(1), cfg=dcfg,
                              spec=spec, num_steps=40).compile().as_text()
    assert cfg.tie_embeddings, "the head should read the token table"
    kernels = [a.shape for path, a in jax.tree_util.tree_leaves_with_path(raw) if path[-1].key == "kernel"]
    kernels.append(raw["wte"]["embedding"].shape)
    shapes = {s for k in kernels for s in (k, (math.prod(k[:-1]), k[-1]), (k[-1], math.prod(k[:-1])),
                                            (k[0], math.prod(k[1:])), (math.prod(k[1:]), k[0]))}
    pattern = "|".join(re.escape("f32[{}]".format(",".join(map(str, s)))) for s in shapes)
    bodies = [hlo[hlo.index(f"\n%{name} "):] for name in re.findall(r"while\(.*?body=%([\w.]+)", hlo)]
    made = [line.strip()[:120] for line in hlo[hlo.index("\n%"):hlo.index("\nENTRY")].splitlines()
            if re.search(rf"= ({pattern})\{{[0-9,]*\}} (?!get-tuple-element|parameter|bitcast)", line)]
    assert any(" dot(" in body for body in bodies), "the model should run inside a while loop"
    assert not made, f"kernel- or table-shaped arrays made inside the decode loop: {made[:3]}"


@pytest.mark.parametrize("name", ["qwen2-like", "nanochat-gqa-scan-xla"])
def test_grouped_query_attention_decodes_one_row_with_one_product_for_q_k_and_v(name: str) -> None:
    """Output-major weights stack grouped-query attention's q and kv kernels (and biases) into one `qkv` per layer,
    scanned layers too, and one row's logits are the declared kernels' (each output row is the same product)."""
    cfg = modern(name)
    raw = random_params(cfg)
    params, dcfg = sampling.decoding_weights(raw, cfg, None, output_major=True)
    attn = params["h" if cfg.scan_layers else "h_0"]["attn"]
    assert "qkv" in attn and not {"q", "kv"} & attn.keys()
    if cfg.qkv_bias:
        assert attn["qkv"]["bias"].shape == (cfg.n_head + 2 * cfg.n_kv_head, cfg.head_dim)
    prompt = jnp.asarray(prompts(cfg, 5, batch=1))
    got, got_cache = sampling._decode(dcfg, params, prompt, init_cache(cfg, 1), 0, True, None)
    want, want_cache = sampling._decode(cfg, raw, prompt, init_cache(cfg, 1), 0, False, None)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(np.abs(want).max()))
    for g, w in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache), strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * max(1.0, float(np.abs(w).max())))


def test_cache_slots_hold_the_generation_in_a_power_of_two() -> None:
    cfg = ModelConfig(vocab_size=50, block_size=1024, n_layer=1, n_head=1, n_embd=8)
    assert sampling.cache_slots(cfg, 1, 500) == 512  # 1 + 499 decoded tokens
    assert sampling.cache_slots(cfg, 13, 500) == 512 and sampling.cache_slots(cfg, 14, 500) == 1024
    assert sampling.cache_slots(cfg, 1, 1) == sampling.SHORTEST_CACHE
    assert sampling.cache_slots(cfg, 2000, 10) == 1024 and sampling.cache_slots(cfg, 1, 1024) == 1024


@pytest.mark.parametrize("batch", [1, 2])
def test_a_shorter_cache_gives_the_same_tokens(monkeypatch, batch: int) -> None:
    """Generations that fit in fewer than block_size slots decode against a cache of that many."""
    monkeypatch.setattr(sampling, "SHORTEST_CACHE", 4)
    cfg = SWEEP["gpt2-scan"]
    prompt = prompts(cfg, 3, batch)
    assert sampling.cache_slots(cfg, 3, 6) == 8 < cfg.block_size
    got = assert_same_generation(cfg, prompt, max_new_tokens=6, temperature=0)
    chunks = list(stream(random_params(cfg), cfg, prompt, max_new_tokens=6, temperature=0, chunk_size=4))
    np.testing.assert_array_equal(np.concatenate(chunks, axis=1), got)
    sampled = generate(random_params(cfg), cfg, prompt, max_new_tokens=6, key=3, top_k=5)
    want = generate_uncached(random_params(cfg), cfg, prompt, max_new_tokens=6, key=3, top_k=5, bucketed=False)
    np.testing.assert_array_equal(sampled, want)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_accelerators_attention_over_the_written_cache_equals_the_cpus(kv_heads: int) -> None:
    """`attend_written` (accelerators: the new key and value written into the cache first) gives `attend_one`'s
    output (CPUs: the cache as it was plus the new key and value), with grouped queries too; rows at different
    positions, as the engine's slots are."""
    from jaxgpt.ops.attention import attend_one, attend_written, write_cache

    B, H, S, D = 3, 4, 16, 8
    q, k, v, old_k, old_v = (jax.random.normal(jax.random.key(i), shape) for i, shape in enumerate(
        [(B, 1, H, D), (B, kv_heads, 1, D), (B, kv_heads, 1, D), (B, kv_heads, S, D), (B, kv_heads, S, D)]))
    index = jnp.array([0, 5, S - 1])

    def per_row(f):  # f on one row (a batch of 1) at its own index, over the B rows
        return jax.vmap(lambda *a: jax.tree.map(lambda x: x[0], f(*jax.tree.map(lambda x: x[None], a[:-1]), a[-1])))
    want, k_new, v_new = per_row(lambda *a: attend_one(*a, "float32"))(q, k, v, old_k, old_v, index)
    cache = per_row(lambda c, kn, vn, i: write_cache(c, kn, vn, i))({"k": old_k, "v": old_v}, k_new, v_new, index)
    got = per_row(lambda qb, kb, vb, i: attend_written(qb, kb, vb, i, "float32"))(q, cache["k"], cache["v"], index)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_fixed_trip_count_loops_give_the_while_loops_tokens(monkeypatch) -> None:
    """The loops accelerators run (`decode_weights.fixed_trip_counts`: every step of a trip runs, those past the loop's
    end masked) give the tokens of the while loops CPUs run: a sliding window (masked steps on a full cache), end
    of text, sampling, streamed chunks and the engine's chunks (`generate_many`)."""
    from jaxgpt.generate import decode_weights
    from jaxgpt.generate.many import generate_many

    cfg = SWEEP["seed001"]
    params, prompt = random_params(cfg), prompts(cfg, 5, seed=3)
    free = generate(params, cfg, prompt, max_new_tokens=3 * cfg.block_size, temperature=0, window_shift=3)
    cases = [dict(max_new_tokens=3 * cfg.block_size, temperature=0, window_shift=3, eot_token=int(free[0, -3])),
             dict(max_new_tokens=2 * cfg.block_size, key=4, top_k=9, window_shift=8)]
    short = [list(p) for p in prompts(cfg, 3, batch=3, seed=5)]

    def run() -> list:
        out = [generate(params, cfg, prompt, **case) for case in cases]
        out.append(np.concatenate(list(stream(params, cfg, prompt, chunk_size=7, **cases[1])), axis=1))
        return [*out, generate_many(params, cfg, short, max_new_tokens=[9, 4, 12], seeds=[1, 2, 3],
                                    temperature=[0.0, 1.0, 0.8], slots=2)]
    want = run()
    jax.clear_caches()  # the programs compiled for CPUs' loops
    monkeypatch.setattr(decode_weights, "current_platform", lambda: "gpu")
    try:
        got = run()
    finally:
        jax.clear_caches()
    for g, w in zip(got[:-1], want[:-1], strict=True):
        np.testing.assert_array_equal(g, w)
    assert got[-1] == want[-1]  # the engine's rows, one list of tokens each


def test_end_of_text_finishes_rows_and_stops_the_loop() -> None:
    cfg = SWEEP["seed001"]
    params, prompt = random_params(cfg), prompts(cfg, 5, seed=3)
    free = generate(params, cfg, prompt, max_new_tokens=30, temperature=0, return_logits=True)[0]
    first = lambda row, t: int(np.flatnonzero(row == t)[0])
    # The eot: a token both rows produce (at different steps), the earliest such, so the loop ends early.
    eot = min(set(free[0]) & set(free[1]), key=lambda t: max(first(free[0], t), first(free[1], t)))
    tokens, logits = generate(params, cfg, prompt, max_new_tokens=30, temperature=0, eot_token=eot, return_logits=True)
    want = free.copy()
    stops = []
    for row in want:
        hits = np.flatnonzero(row == eot)
        stops.append(hits[0] if hits.size else len(row))
        row[stops[-1]:] = eot
    np.testing.assert_array_equal(tokens, want)
    last = max(stops)
    assert stops[0] != stops[1] and last + 1 < tokens.shape[1]
    assert logits[:, last].any() and not logits[:, last + 1:].any()  # the steps after the last eot never ran
    chunks = list(stream(params, cfg, prompt, max_new_tokens=30, temperature=0, eot_token=eot, chunk_size=7))
    np.testing.assert_array_equal(np.concatenate(chunks, axis=1), tokens[:, : sum(c.shape[1] for c in chunks)])


def test_filter_logits_top_k_then_top_p() -> None:
    logits = jnp.log(jnp.array([[0.5, 0.05, 0.2, 0.15, 0.1]]))
    kept = lambda **kw: np.isfinite(np.asarray(filter_logits(logits, **kw)))[0].tolist()
    assert kept(top_k=2) == [True, False, True, False, False]
    assert kept(top_p=0.5) == [True, False, False, False, False]  # the top token alone reaches 0.5
    assert kept(top_p=0.51) == [True, False, True, False, False]
    assert kept(top_p=0.86) == [True, False, True, True, True]
    assert kept(top_p=1.0) == [True] * 5
    assert kept(top_p=1e-6) == [True, False, False, False, False]  # the most likely token always survives
    # top-p on what top-k left: {0.5, 0.2, 0.15} renormalized is (0.59, 0.24, 0.18): 0.85 needs all three
    assert kept(top_k=3, top_p=0.85) == [True, False, True, True, False]
    assert kept(top_k=3, top_p=0.8) == [True, False, True, False, False]
    ties = jnp.array([[1.0, 3.0, 3.0, 0.0]])
    assert np.isfinite(np.asarray(filter_logits(ties, top_k=1)))[0].tolist() == [False, True, True, False]


def test_sampled_frequencies_follow_the_filtered_distribution() -> None:
    logits_V = jnp.log(jnp.array([0.4, 0.3, 0.15, 0.1, 0.05]))
    n = 40_000
    logits_NV = jnp.broadcast_to(logits_V, (n, 5))
    gumbel_NV = jax.random.gumbel(jax.random.key(0), (n, 5))
    cases = [(dict(), 1.0), (dict(), 0.5), (dict(top_k=3), 1.0), (dict(top_p=0.75), 2.0)]
    draw = jax.jit(pick_tokens, static_argnames=("top_k",))
    for kwargs, temperature in cases:
        probs = np.exp(np.asarray(filter_logits(logits_V[None] / temperature, **kwargs))[0])
        probs /= probs.sum()
        freq = np.bincount(np.asarray(draw(logits_NV, gumbel_NV, temperature, **kwargs)), minlength=5) / n
        np.testing.assert_allclose(freq, probs, atol=0.01)
        assert (freq[probs == 0] == 0).all()


def test_first_argmax_is_argmax() -> None:
    rng = np.random.default_rng(0)
    x = rng.integers(-3, 3, size=(64, 37)).astype(np.float32)  # many ties
    x[1] = -np.inf
    x[2, [5, 9]] = np.nan
    x[3, 7] = np.inf
    np.testing.assert_array_equal(strategies.first_argmax(jnp.asarray(x)), np.argmax(x, axis=-1))
    assert strategies.first_argmax(jnp.asarray(x)).dtype == jnp.int32


def test_greedy_ignores_the_key_and_takes_the_argmax() -> None:
    logits = jnp.array([[0.1, 2.0, -1.0], [5.0, 4.9, 0.0]])
    assert pick_tokens(logits, None).tolist() == [1, 0]
    assert pick_tokens(logits, None, banned=0).tolist() == [1, 1]


@pytest.mark.parametrize("changes, message", [
    (dict(max_new_tokens=0), "max_new_tokens=0 must be a positive integer"),
    (dict(max_new_tokens=-3), "max_new_tokens=-3"),
    (dict(temperature=-0.5), "temperature=-0.5 must be >= 0"),
    (dict(temperature=float("nan")), "temperature=nan"),
    (dict(top_k=0), "top_k=0 must be an integer >= 1"),
    (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p=1.5 must be in \(0, 1\]"),
    (dict(window_shift=0), r"window_shift=0 must be an integer in \[1, block_size=16\]"),
    (dict(window_shift=17), "window_shift=17"),
    (dict(prompt=np.zeros((2, 0), int)), "the prompt is empty"),
    (dict(prompt=[3, 61]), r"prompt token ids \[61\] are outside the vocabulary \[0, 61\)"),
    (dict(prompt=[3, 0, 4]), "contains the model's padding id 0"),
    (dict(eot_token=99), "eot_token=99 is outside the vocabulary"),
    (dict(prompt=np.ones((2, 3), int), num_samples=3), "num_samples=3 disagrees with the prompt batch of 2"),
])
@pytest.mark.parametrize("fn", [generate, generate_uncached, stream])
def test_bad_options_are_user_errors(fn, changes: dict, message: str) -> None:
    cfg = SWEEP["seed001"]
    kwargs = dict(prompt=[1, 2, 3], max_new_tokens=5) | changes
    with pytest.raises(UserError, match=message):
        out = fn(random_params(cfg), cfg, kwargs.pop("prompt"), **kwargs)
        next(iter(out)) if fn is stream else None


# ----------------------------------------------------------------------------------------------------
# The command line


CHARS = "\n !,.0123456789?ABCDEFGHIJKLMNPRSTabcdefghijklmnopqrstuvwxyzé"  # SAMPLED_CFG: 61, pad id 0 = "\\n"
assert len(CHARS) == SAMPLED_CFG.vocab_size


@pytest.fixture(scope="module")
def char_workdir(tmp_path_factory) -> Path:
    """A work directory holding one checkpoint of a tiny character model, written with the trainer's API."""
    from jaxgpt.io.checkpoint import Checkpointer

    workdir = tmp_path_factory.mktemp("char_run")
    cfg = SAMPLED_CFG
    ckpt = Checkpointer(workdir)
    ckpt.save({"params": random_params(cfg), "opt_state": {"count": jnp.zeros((), jnp.int32)}, "step": 3},
              {"model": cfg.to_dict(), "tokenizer": CharTokenizer(CHARS).to_meta(), "val_loss": 1.0})
    ckpt.close()
    return workdir


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    code = cli.main(["jaxgpt sample", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_streams_one_sample_equal_to_the_library(char_workdir: Path, capsys) -> None:
    options = [f"--{k}={v}" for k, v in SAMPLED.items()]
    code, out, err = run_cli(["--workdir", str(char_workdir), "--prompt", "hello", "--seed", "5", "--stream_chunk",
                              "4", *options], capsys)
    assert code == 0, err
    loaded = weights.load(f"workdir:{char_workdir}")
    params, cfg = loaded.params, loaded.model
    tok = CharTokenizer(CHARS)
    want = np.concatenate(list(stream(params, cfg, tok.encode("hello"), key=5, chunk_size=4, **SAMPLED)), axis=1)
    assert out == "hello" + tok.decode(want[0].tolist()) + "\n"


def test_cli_dtype_bfloat16_decodes_with_the_library_in_bfloat16(char_workdir: Path, capsys) -> None:
    code, out, err = run_cli(["--workdir", str(char_workdir), "--prompt", "hello", "--temperature", "0",
                              "--max_new_tokens", "12", "--dtype", "bfloat16"], capsys)
    assert code == 0, err
    loaded = weights.load(f"workdir:{char_workdir}")
    tok = CharTokenizer(CHARS)
    want = generate(loaded.params, loaded.model, tok.encode("hello"), max_new_tokens=12, temperature=0,
                    dtype="bfloat16")
    assert out == "hello" + tok.decode(want[0].tolist()) + "\n"


def test_cli_prints_several_samples_separated(char_workdir: Path, capsys) -> None:
    options = [f"--{k}={v}" for k, v in SAMPLED.items()]
    code, out, _ = run_cli(["--workdir", str(char_workdir), "--which", "best", "--prompt", "abcde", "--num_samples",
                            "2", "--seed", "1", *options], capsys)
    samples = out.rstrip("\n").split("\n" + cli.SEPARATOR + "\n")
    assert code == 0 and len(samples) == 2 and all(s.startswith("abcde") and len(s) == 35 for s in samples)
    assert len(set(samples)) > 1


@pytest.mark.parametrize("args, message", [
    (["--prompt", ""], "the prompt is empty and this character vocabulary has no start token: give --prompt"),
    (["--prompt", "hi ÅX"], "characters outside the 61-character vocabulary: 'Å', 'X'"),
    (["--prompt", "a", "--max_new_tokens", "0"], "max_new_tokens=0 must be a positive integer"),
    (["--prompt", "a", "--top_p", "1.5"], r"top_p=1.5 must be in \(0, 1\]"),
    (["--prompt", "a", "--top_p", "0"], r"top_p=0.0 must be in \(0, 1\]"),
    (["--prompt", "a", "--top_k", "0"], "top_k=0 must be an integer >= 1"),
    (["--prompt", "a", "--temperature", "-1"], "temperature=-1.0 must be >= 0"),
    (["--prompt", "a", "--num_samples", "0"], "--num_samples=0 must be at least 1"),
    (["--prompt_file", "/nonexistent/prompt.txt"], "cannot read --prompt_file /nonexistent/prompt.txt"),
    (["--prompt", "a", "--top_k", "two"], "bad command line: flag --top_k=two: invalid literal for int"),
    (["--prompt", "a", "--prompt_file", "x"], r"At most one of \(prompt, prompt_file\)"),
])
def test_cli_bad_input_is_one_line_and_exit_2(char_workdir: Path, capsys, args: list[str], message: str) -> None:
    code, out, err = run_cli(["--workdir", str(char_workdir), *args], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert __import__("re").search(message, err), err


def test_cli_workdir_without_checkpoint(tmp_path: Path, capsys) -> None:
    code, _, err = run_cli(["--workdir", str(tmp_path), "--prompt", "a"], capsys)
    assert code == 2 and err.startswith("error: ") and "has no checkpoints" in err and err.count("\n") == 1


def test_cli_process_exit_code_and_no_traceback(char_workdir: Path) -> None:
    bad = subprocess.run([sys.executable, "sample.py", "--workdir", str(char_workdir), "--prompt", "Q"], cwd=ROOT,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("error: ") and bad.stderr.count("\n") == 1 and "'Q'" in bad.stderr, bad.stderr


def test_stream_decoder_holds_back_partial_utf8() -> None:
    tok = bpe_or_skip()
    text = "naïve café 🙂 done"
    ids = tok.encode(text)
    out = StreamDecoder(tok)
    pieces = [out.push([i]) for i in ids] + [out.push([], final=True)]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)


def test_stream_decoder_decodes_each_id_a_few_times_and_gives_the_whole_text() -> None:
    """A long stream costs linear time (the ids decoded grow with the tokens, not with their square), and its
    pieces are the text of all the ids after the prompt's: across characters split between tokens, and with the
    space a word tokenizer puts between words."""
    bpe = bpe_or_skip()
    words = WordTokenizer.from_texts(["the cat sat on the mat"], 10)
    for tok, prompt, text in [(bpe, "Once: ", "naïve café 🙂 done. " * 100), (words, "mat", "the cat sat on " * 100)]:
        counting, ids = CountingDecodes(tok), tok.encode(text)
        out = StreamDecoder(counting, tok.encode(prompt))
        pieces, at = [], 0
        while at < len(ids):  # pieces of 1 to 3 ids
            pieces.append(out.push(ids[at:at + 1 + at % 3]))
            at += 1 + at % 3
        pieces.append(out.push([], final=True))
        assert "".join(pieces) == tok.decode(tok.encode(prompt) + ids)[len(tok.decode(tok.encode(prompt))):]
        assert counting.decoded < 8 * len(ids) + 2 * len(prompt)


def test_cli_preset_demo_pipeline_on_a_shrunk_seed000(monkeypatch, capsys) -> None:
    """Seed 000's demo with the r50k vocabulary, the model shrunk so the test is quick (full size: slow test).

    An empty prompt starts from end-of-text with a BPE tokenizer."""
    bpe_or_skip()
    small = PRESETS["seed000"].replace(n_layer=1, n_embd=16, n_head=2, d_ff=32, block_size=16)
    monkeypatch.setattr(weights, "get_preset", lambda name: small)
    monkeypatch.setattr(weights, "init_params", lambda cfg, key: random_params(cfg))  # jit(init) takes seconds
    demo = ["--preset", "seed000", "--max_new_tokens", "10", "--temperature", "0", "--batch_size", "2"]
    code, out, err = run_cli([*demo, "--prompt", "A long time ago"], capsys)
    assert code == 0, err
    samples = out.rstrip("\n").split("\n" + cli.SEPARATOR + "\n")
    assert len(samples) == 2 and samples[0] == samples[1] and samples[0].startswith("A long time ago")
    assert "randomly initialized" in err
    code, out, err = run_cli(demo, capsys)
    assert code == 0 and out.count(cli.SEPARATOR) == 1, err


def test_cli_preset_needs_the_gpt2_vocabulary(capsys) -> None:
    code, _, err = run_cli(["--preset", "seed002", "--prompt", "a"], capsys)
    assert code == 2 and "has a 2048-token vocabulary" in err


@pytest.mark.slow
def test_seed000_demo_full_size_from_the_command_line() -> None:
    """The acceptance demo as a user runs it: ~70M random parameters, r50k vocabulary, 10 greedy tokens."""
    bpe_or_skip()
    result = subprocess.run([sys.executable, "sample.py", "--preset", "seed000", "--prompt", "A long time ago",
                             "--max_new_tokens", "10", "--temperature", "0", "--batch_size", "3"], cwd=ROOT,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    samples = result.stdout.rstrip("\n").split("\n" + cli.SEPARATOR + "\n")
    assert len(samples) == 3 and all(s.startswith("A long time ago") for s in samples)


def test_noise_block_matches_single_steps() -> None:
    """Noise drawn ahead for a block of steps is the noise of each step drawn alone."""
    key = jax.random.key(3)
    block = strategies.noise_block(key, jnp.int32(5), 4, (2, 7))
    for i in range(4):
        np.testing.assert_array_equal(block[i], strategies.gumbel_noise(key, jnp.int32(5 + i), (2, 7)))
    assert math.isfinite(float(block.sum()))


def test_cli_samples_from_a_hugging_face_gpt2_directory(tmp_path: Path, capsys) -> None:
    """--init_from hf:PATH: the imported weights give the library's greedy tokens, decoded with GPT-2 BPE."""
    bpe_or_skip()
    from jaxgpt.data.tokenizer import load_bpe
    from jaxgpt.io.hf import save_hf

    cfg = PRESETS["gpt2"].replace(n_layer=1, n_embd=16, n_head=2, block_size=16)
    params = random_params(cfg)
    save_hf(params, cfg, tmp_path / "hf")
    code, out, err = run_cli(["--init_from", f"hf:{tmp_path / 'hf'}", "--prompt", "A long time ago",
                              "--max_new_tokens", "6", "--temperature", "0"], capsys)
    assert code == 0, err
    tok = load_bpe("gpt2")
    want = generate(params, cfg, tok.encode("A long time ago"), max_new_tokens=6, temperature=0.0,
                    eot_token=tok.eot_token)[0].tolist()
    if tok.eot_token in want:
        want = want[: want.index(tok.eot_token)]
    assert out.rstrip("\n") == "A long time ago" + tok.decode(want)
    code, _, err = run_cli(["--init_from", "nowhere:x", "--prompt", "a"], capsys)
    assert code == 2 and "hf:PATH" in err


def test_vocabulary_padding_ids_are_never_sampled() -> None:
    """A model whose vocabulary is padded past its tokenizer's (GPT-2's 50257 -> 50304) never emits the padding."""
    from jaxgpt.generate.strategies import pick_tokens

    logits = jnp.zeros((2, 8)).at[:, 6].set(10.0)  # the padding id 6 is by far the likeliest
    assert pick_tokens(logits, None, vocab_limit=6).tolist() == [0, 0]
    noise = jax.random.gumbel(jax.random.key(0), (2, 8))
    assert all(t < 6 for t in pick_tokens(logits, noise, 1.0, vocab_limit=6).tolist())
    cfg = SWEEP["seed004"]
    params = random_params(cfg)
    free = generate(params, cfg, prompts(cfg, 4), max_new_tokens=60, key=3)
    limit = int(np.median(free))  # about half of what the model samples freely lies past it
    assert (free >= limit).any()
    for fn in (generate, generate_uncached):
        tokens = fn(params, cfg, prompts(cfg, 4), max_new_tokens=60, key=3, vocab_limit=limit)
        assert tokens.max() < limit


@pytest.mark.parametrize("value", ["0", str(2**20 + 1), str(2**31), "-5"])
def test_max_new_tokens_out_of_range_is_one_line(value: str, char_workdir: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    code = cli.main(["sample.py", "--workdir", str(char_workdir), "--prompt", "a", "--max_new_tokens", value])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1 and "max_new_tokens" in err


@functools.cache
def trained_counter() -> tuple[dict, ModelConfig]:
    """A tiny model trained (300 AdamW steps) on a deterministic sequence, so its argmax margins are wide
    (200 left one margin at 0.46 of a logit on jax 0.12, under twice the bf16 tolerance; 300: 1.4 and 4.0).

    Each token is the previous one plus the one before it, mod 13: the next token depends on two positions, so
    attention has to work, and every prediction is certain once learned.
    """
    cfg = ModelConfig(vocab_size=13, block_size=16, n_layer=2, n_head=2, n_embd=32)
    seq = [1, 2]
    while len(seq) < 400:
        seq.append((seq[-1] + seq[-2]) % 13)
    windows_NT = np.lib.stride_tricks.sliding_window_view(np.array(seq), 17)
    params = sampling.GPT(cfg).init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))["params"]
    opt = optax.adamw(1e-2)

    @jax.jit
    def step(params, opt_state, batch_BT):
        def loss(p):
            logits = sampling.GPT(cfg).apply({"params": p}, batch_BT[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch_BT[:, 1:]).mean()
        grads = jax.grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = opt.init(params)
    for i in range(300):
        params, opt_state = step(params, opt_state, jnp.asarray(windows_NT[(np.arange(16) * 23 + i * 7) % 384]))
    return params, cfg


def test_bfloat16_decoding_follows_float32() -> None:
    """bf16 weights and activations: float32 logits within bf16 rounding of float32's, and the same greedy tokens."""
    params, cfg = trained_counter()
    prompt = np.array([[3, 5, 8], [7, 1, 8]])  # two starting pairs of the rule, one not in the training sequence
    want, want_logits = generate(params, cfg, prompt, max_new_tokens=40, temperature=0, return_logits=True)
    got, got_logits = generate(params, cfg, prompt, max_new_tokens=40, temperature=0, return_logits=True,
                               dtype="bfloat16")
    assert got_logits.dtype == np.float32
    top2 = np.sort(want_logits, axis=-1)[..., -2:]
    tolerance = 0.02 * np.abs(want_logits).max()  # bf16 keeps 8 bits (0.4% per rounding); its errors partly cancel
    assert (top2[..., 1] - top2[..., 0]).min() > 2 * tolerance, "the trained model should be sure of each token"
    np.testing.assert_allclose(got_logits, want_logits, rtol=0, atol=tolerance)
    assert not np.array_equal(got_logits, want_logits)  # it did compute in bf16
    np.testing.assert_array_equal(got, want)
    expected = list(prompt[0])
    for _ in range(40):
        expected.append((expected[-1] + expected[-2]) % 13)
    np.testing.assert_array_equal(want[0], expected[3:])  # and the model learned the rule
    chunks = list(stream(params, cfg, prompt, max_new_tokens=40, temperature=0, chunk_size=40, dtype="bfloat16"))
    np.testing.assert_array_equal(np.concatenate(chunks, axis=1), got)
    # one row: output-major float32 images of the bf16 kernels on CPUs (`generate.decode_weights.decoding_weights`)
    one, one_logits = generate(params, cfg, prompt[:1], max_new_tokens=40, temperature=0, return_logits=True,
                               dtype="bfloat16")
    np.testing.assert_allclose(one_logits, want_logits[:1], rtol=0, atol=tolerance)
    np.testing.assert_array_equal(one, got[:1])


def test_decoding_weights_are_prepared_once_per_set_of_weights() -> None:
    """Generating again from the same weights reuses their decoding layout; new weights get their own."""
    cfg = SWEEP["seed001"]
    params = jax.tree.map(jnp.copy, random_params(cfg))
    first, _ = sampling.decoding_weights(params, cfg, None, output_major=True)
    again, _ = sampling.decoding_weights(params, cfg, None, output_major=True)
    assert again is first
    other = jax.tree.map(jnp.copy, params)
    assert sampling.decoding_weights(other, cfg, None, output_major=True)[0] is not first
    assert sampling.decoding_weights(params, cfg, "bfloat16", output_major=True)[0] is not first
