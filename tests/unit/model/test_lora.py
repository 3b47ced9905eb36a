"""LoRA's math (`jaxgpt.model.lora`): merged = base + scaled A B per target and slot, an exact start, bad targets."""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
import pytest
from helpers.models import modern, random_params, shrink

from jaxgpt.errors import UserError
from jaxgpt.model import lora
from jaxgpt.model.gpt import GPT, abstract_variables
from jaxgpt.model.presets import get_preset

# (model, what its attention kernels are): GPT-2's fused qkv, grouped-query q + kv, scanned layers
MODELS = {"fused": shrink(get_preset("gpt2")), "gqa": modern("gqa"),
          "scanned": shrink(get_preset("gpt2")).replace(scan_layers=True),
          "gated-untied": modern("gqa").replace(gated_mlp=True, activation="silu", tie_embeddings=False)}


def randomized(found: list[lora.Site], seed: int) -> dict:
    """Adapters with B != 0 (a trained adapter), as host arrays."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: rng.normal(0, 0.1, a.shape).astype(np.float32),
                        nn.unbox(lora.init_adapters(found, jax.random.key(seed))))


def numpy_merge(base: dict, adapters: dict, s: float) -> dict:
    """The float64 merge, written out per kernel: W[..., slot, ...] += s * (A flattened (in, r)) @ (B (r, out))."""
    out = jax.tree.map(lambda a: np.asarray(a, np.float64), base)
    for module, target, ab in lora.adapter_leaves(adapters):
        node = out
        for name in module:
            node = node[name]
        a, b = np.asarray(ab["lora_a"], np.float64), np.asarray(ab["lora_b"], np.float64)
        n_in = 2 if module[-1] == "out" else 1
        lead = a.ndim - n_in - 1
        for index in np.ndindex(*a.shape[:lead]):
            ai, bi = a[index], b[index]
            d = (ai.reshape(-1, ai.shape[-1]) @ bi.reshape(bi.shape[0], -1)).reshape(*ai.shape[:-1], *bi.shape[1:])
            slot = dict(lora.MODULES[(module[-2] if len(module) > 1 else "", module[-1])])[target]
            view = node[lora.weight_name(module[-1])][index]
            if slot is None:
                view += s * d
            else:
                view[(slice(None),) * n_in + (slot,)] += s * d
    return out


def every_target(cfg) -> tuple[str, ...]:
    """Every target the model has: the blocks' (gate if gated), an untied head, and the token table (whose tied
    head then reads the adapted table)."""
    return (*(t for t in lora.LINEAR if t != "gate" or cfg.gated_mlp), *(() if cfg.tie_embeddings else ("head",)),
            "embed")


def sites_of(cfg, targets=(), rank=4):
    return lora.sites(abstract_variables(cfg)["params"], targets, rank)


@pytest.mark.parametrize("name", list(MODELS))
def test_merge_is_base_plus_scaled_a_b_in_each_slot(name: str) -> None:
    cfg = MODELS[name]
    found = sites_of(cfg, every_target(cfg))
    base, adapters = jax.device_get(random_params(cfg)), randomized(found, 1)
    s = lora.scale(8.0, 4, rslora=False)
    merged = lora.merge(base, adapters, s)
    expected = numpy_merge(base, adapters, s)
    jax.tree.map(lambda m, e: np.testing.assert_allclose(np.asarray(m), e, rtol=1e-5, atol=1e-6), merged, expected)
    changed = [k for k, (m, b) in zip(jax.tree_util.tree_leaves_with_path(merged), zip(
        jax.tree.leaves(merged), jax.tree.leaves(base), strict=True), strict=True) if not np.array_equal(m, b)]
    assert len(changed) == len({(m, "kernel") for m, _, _ in lora.adapter_leaves(adapters)})  # only adapted kernels


def test_each_of_q_k_v_adapts_its_own_slot_of_the_fused_kernel() -> None:
    cfg = MODELS["fused"]
    base = jax.device_get(random_params(cfg))
    for slot, target in enumerate("qkv"):
        merged = lora.merge(base, randomized(sites_of(cfg, (target,)), 2), 1.0)
        for layer in ("h_0", "h_1"):
            diff = np.abs(np.asarray(merged[layer]["attn"]["qkv"]["kernel"]) - base[layer]["attn"]["qkv"]["kernel"])
            assert [bool(diff[:, i].max() > 0) for i in range(3)] == [i == slot for i in range(3)]


def test_at_init_the_adapted_model_is_the_base_exactly() -> None:
    cfg = MODELS["gqa"]
    base = random_params(cfg)
    adapters = nn.unbox(lora.init_adapters(sites_of(cfg), jax.random.key(0)))
    assert all(np.abs(np.asarray(a)).max() > 0 for a in jax.tree.leaves(adapters)[::2])  # A random, B zero
    tokens = np.arange(8)[None] % cfg.vocab_size
    model = GPT(cfg)
    np.testing.assert_array_equal(model.apply({"params": lora.merge(base, adapters, 2.0)}, tokens),
                                  model.apply({"params": base}, tokens))


def test_the_token_table_adapter_starts_as_peft_embedding_with_the_model_unchanged() -> None:
    cfg = MODELS["gqa"]
    (site,) = sites_of(cfg, ("embed",), rank=3)
    assert site.path == ("wte",) and site.a_shape == (cfg.vocab_size, 3) and site.a_names == ("vocab", "lora")
    assert site.b_shape == (3, cfg.n_embd) and site.b_names == ("lora", "embed")
    ab = nn.unbox(lora.init_adapters([site], jax.random.key(0)))["wte"]["embed"]
    assert not np.asarray(ab["lora_a"]).any() and 0.8 < np.asarray(ab["lora_b"]).std() < 1.2  # A zero, B N(0, 1)
    base, tokens = random_params(cfg), np.arange(8)[None] % cfg.vocab_size
    model = GPT(cfg)
    np.testing.assert_array_equal(model.apply({"params": lora.overlay(base, {"wte": {"embed": ab}}, 2.0)}, tokens),
                                  model.apply({"params": base}, tokens))


def test_adapters_carry_logical_names_and_shapes() -> None:
    found = {(s.path, s.target): s for s in sites_of(MODELS["scanned"], rank=3)}
    q = found[(("h", "attn", "qkv"), "q")]
    assert q.a_shape == (2, 32, 3) and q.a_names == ("layers", "embed", "lora")
    assert q.b_shape == (2, 3, 4, 8) and q.b_names == ("layers", "lora", "heads", "head_dim")
    o = found[(("h", "attn", "out"), "o")]
    assert o.a_shape == (2, 4, 8, 3) and o.b_names == ("layers", "lora", "embed")


def test_scale_is_alpha_over_rank_or_its_root() -> None:
    assert lora.scale(16.0, 4, False) == 4.0 and lora.scale(16.0, 4, True) == 8.0


@pytest.mark.parametrize(("targets", "rank", "message"), [
    (("head",), 4, "does not have"),  # tied embeddings: no head kernel
    (("gate",), 4, "does not have"),  # GPT-2's MLP is not gated
    (("q",), 33, "larger than"),
])
def test_bad_targets_and_ranks_are_one_line_errors(targets: tuple, rank: int, message: str) -> None:
    with pytest.raises(UserError, match=message) as e:
        sites_of(MODELS["fused"], targets, rank)
    assert "\n" not in str(e.value)


def test_digest_tells_bases_apart() -> None:
    base = jax.device_get(random_params(MODELS["fused"]))
    other = jax.tree.map(lambda a: a, base)
    other["h_0"]["attn"]["qkv"]["kernel"] = other["h_0"]["attn"]["qkv"]["kernel"] + np.float32(1e-7)
    assert lora.digest(base) == lora.digest(jax.tree.map(np.copy, base)) != lora.digest(other)


@pytest.mark.parametrize(("patterns", "paths"), [
    (("wte",), {("wte", "embedding")}),
    (("ln_*",), {(f"h_{i}", f"ln_{j}", p) for i in range(2) for j in (1, 2) for p in ("scale", "bias")}
     | {("ln_f", "scale"), ("ln_f", "bias")}),
    (("h_1/ln_1", "ln_f/bias"), {("h_1", "ln_1", "scale"), ("h_1", "ln_1", "bias"), ("ln_f", "bias")}),
    (("mlp/*/bias",), {(f"h_{i}", "mlp", m, "bias") for i in range(2) for m in ("fc", "proj")}),
])
def test_modules_to_save_patterns_match_runs_of_path_names(patterns: tuple, paths: set) -> None:
    cfg = MODELS["fused"]
    assert set(lora.saved_params(abstract_variables(cfg)["params"], patterns, sites_of(cfg, ("q",)))) == paths


def test_saved_parameters_replace_the_base_in_merge_and_overlay_and_get_gradients() -> None:
    """The trainable tree's SAVED parameters stand in for the base's (merged and unmerged alike), and a loss
    differentiates them as it does the adapters; the frozen base's other parameters are read as they are."""
    cfg = MODELS["fused"]
    boxed = abstract_variables(cfg)["params"]
    found = sites_of(cfg, ("q", "v"))
    saved = lora.saved_params(boxed, ("wpe", "ln_f"), found)
    base = random_params(cfg)
    trainable = {**randomized(found, 1), **lora.saved_from(jax.tree.map(lambda a: a * 1.5, base), saved)}
    s = lora.scale(8.0, 4, False)
    merged = lora.merge(base, trainable, s)
    np.testing.assert_array_equal(merged["wpe"]["embedding"], 1.5 * base["wpe"]["embedding"])
    np.testing.assert_array_equal(merged["ln_f"]["bias"], 1.5 * base["ln_f"]["bias"])
    np.testing.assert_array_equal(merged["h_0"]["ln_1"]["scale"], base["h_0"]["ln_1"]["scale"])
    x = np.arange(12).reshape(1, 12) % cfg.vocab_size
    logits = lambda t: GPT(cfg).apply({"params": lora.overlay(base, t, s)}, x)
    np.testing.assert_allclose(logits(trainable), GPT(cfg).apply({"params": merged}, x), atol=1e-4)
    grads = jax.grad(lambda t: logits(t).sum())(trainable)
    assert jax.tree.structure(grads) == jax.tree.structure(trainable)
    assert all(np.abs(g).max() > 0 for g in jax.tree.leaves(grads[lora.SAVED]))
    init = nn.unbox(lora.Adapters(found, saved).init(jax.random.key(0))["params"])
    assert jax.tree.map(np.shape, init[lora.SAVED]) == jax.tree.map(np.shape, trainable[lora.SAVED])
