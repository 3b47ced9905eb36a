"""Unmerged LoRA (`lora.overlay`, `EinsumDense`): adapters beside the kernels compute what merged kernels compute,
one adapter (training's form) or several stacked in one batch (serving's), and change nothing when absent."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.models import prompts, random_params
from test_lora import MODELS, every_target, randomized, sites_of

from jaxgpt.model import lora
from jaxgpt.model.attention import init_cache
from jaxgpt.model.gpt import GPT


@pytest.mark.parametrize("name", list(MODELS))
def test_overlay_equals_merge(name: str) -> None:
    cfg = MODELS[name]
    base, adapters, s = random_params(cfg), randomized(sites_of(cfg, every_target(cfg)), 1), 0.7
    tokens = prompts(cfg, 8)
    model = GPT(cfg)
    merged = model.apply({"params": lora.merge(base, adapters, s)}, tokens)
    overlaid = model.apply({"params": lora.overlay(base, adapters, s)}, tokens)
    plain = model.apply({"params": base}, tokens)
    np.testing.assert_allclose(overlaid, merged, rtol=1e-4, atol=1e-4)
    assert np.abs(np.asarray(merged) - np.asarray(plain)).max() > 1e-2  # the adapters do change the model


def test_overlay_puts_entries_beside_kernels_without_copying_them() -> None:
    cfg = MODELS["scanned"]
    base, adapters = random_params(cfg), randomized(sites_of(cfg, every_target(cfg)), 1)
    out = lora.overlay(base, adapters, 2.0, dropout=0.1, key=jax.random.key(0))
    assert out["wte"]["embedding"] is base["wte"]["embedding"] and set(out["wte"]["embed"]) == {"lora_a", "lora_b"}
    qkv = out["h"]["attn"]["qkv"]
    assert qkv["kernel"] is base["h"]["attn"]["qkv"]["kernel"] and set(qkv) >= {"kernel", "q", "k", "v"}
    np.testing.assert_array_equal(qkv["q"]["lora_b"], 2.0 * adapters["h"]["attn"]["qkv"]["q"]["lora_b"])
    assert qkv["q"]["dropout"].shape == (cfg.n_layer,) and out["h"]["attn"]["out"]["o"]["dropout"].shape == (2,)
    assert qkv["q"]["dropout_key"].shape[0] == cfg.n_layer
    assert not np.array_equal(qkv["q"]["dropout_key"], qkv["k"]["dropout_key"])  # each target drops its own units


def test_without_adapters_the_model_is_bit_identical() -> None:
    cfg = MODELS["gqa"]
    base, tokens = random_params(cfg), prompts(cfg, 8)
    model = GPT(cfg)
    assert lora.overlay(base, {}, 3.0) == base
    np.testing.assert_array_equal(model.apply({"params": lora.overlay(base, {}, 3.0)}, tokens),
                                  model.apply({"params": base}, tokens))


def stack(adapter_list: list[dict], adapter_B: list[int | None]) -> dict:
    """N single adapters (scales folded into B) as one stacked tree: packed side by side along the rank axis, and
    "rows" (Bt, sum of ranks) masking row b onto adapter `adapter_B[b]`'s columns (None: none), with scanned
    layers' L axis first."""
    ranks = [next(ab for _, _, ab in lora.adapter_leaves(ad))["lora_a"].shape[-1] for ad in adapter_list]
    starts = np.cumsum([0, *ranks])
    rows = np.zeros((len(adapter_B), starts[-1]), np.float32)
    for row, n in enumerate(adapter_B):
        if n is not None:
            rows[row, starts[n]:starts[n + 1]] = 1.0
    out: dict = {}
    for module, target, _ in lora.adapter_leaves(adapter_list[0]):
        a_s, b_s = [], []
        for ad in adapter_list:
            ab = next(e for m, t, e in lora.adapter_leaves(ad) if (m, t) == (module, target))
            a_s.append(np.asarray(ab["lora_a"]))
            b_s.append(np.asarray(ab["lora_b"]))
        lead = a_s[0].ndim - (2 if module[-1] == "out" else 1) - 1  # scanned layers' L axis stays first
        node = out
        for name in module:
            node = node.setdefault(name, {})
        node[target] = {"lora_a": np.concatenate(a_s, -1), "lora_b": np.concatenate(b_s, lead),
                        "rows": np.broadcast_to(rows, (*a_s[0].shape[:lead], *rows.shape))}
    return out


@pytest.mark.parametrize("name", ["fused", "scanned", "gated-untied"])
def test_stacked_adapters_of_different_ranks_equal_each_merged_model_row_by_row(name: str) -> None:
    cfg = MODELS[name]
    scales = (0.5, 1.0, 2.0)
    adapters = [randomized(sites_of(cfg, every_target(cfg), rank=r), seed) for seed, r in enumerate((2, 4, 3))]
    base, model = random_params(cfg), GPT(cfg)
    uses = (2, 0, 1, None)  # rows 0..2 use adapters 2, 0, 1; row 3 the base alone
    folded = [lora.overlay({}, ad, s) for ad, s in zip(adapters, scales, strict=True)]
    tokens = prompts(cfg, 8, batch=4)
    out = np.asarray(model.apply({"params": lora.overlay(base, stack(folded, list(uses)), 1.0)}, tokens))
    for row, n in enumerate(uses):
        params = base if n is None else lora.merge(base, adapters[n], scales[n])
        expected = np.asarray(model.apply({"params": params}, tokens[row:row + 1]))[0]
        np.testing.assert_allclose(out[row], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["fused", "scanned"])
def test_cached_decoding_with_overlaid_adapters_equals_the_merged_model(name: str) -> None:
    cfg = MODELS[name]
    base, adapters, s = random_params(cfg), randomized(sites_of(cfg, every_target(cfg)), 3), 1.5
    model, tokens = GPT(cfg), prompts(cfg, 6)

    def decode(params: dict) -> np.ndarray:
        cache = init_cache(cfg, tokens.shape[0], 8)
        logits, cache = model.apply({"params": params}, tokens[:, :4], cache, jnp.int32(0), method=GPT.decode)
        steps = [logits]
        for i in (4, 5):
            logits, cache = model.apply({"params": params}, tokens[:, i:i + 1], cache, jnp.int32(i),
                                        method=GPT.decode)
            steps.append(logits)
        return np.concatenate(steps, axis=1)

    np.testing.assert_allclose(decode(lora.overlay(base, adapters, s)), decode(lora.merge(base, adapters, s)),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rate", [0.05, 0.3])
def test_lora_dropout_drops_x_before_a_at_the_rate_and_is_unbiased(rate: float) -> None:
    """With A and B identities, the output projection's adapter adds drop(x) itself: a share `rate` of it zero, the
    rest x / (1 - rate); the same key drops the same units, another key others."""
    H, D = 4, 8
    x_BTHD = jnp.asarray(np.random.default_rng(0).normal(size=(4, 64, H, D)), jnp.float32)
    eye = {"out": {"o": {"lora_a": jnp.eye(H * D).reshape(H, D, H * D), "lora_b": jnp.eye(H * D)}}}

    def added(seed: int) -> np.ndarray:
        entries = lora.overlay({}, eye, dropout=rate, key=jax.random.key(seed))["out"]
        return np.asarray(lora.project_adapters("bthd,hdc->btc", "out", x_BTHD, jnp.zeros((4, 64, H * D)), entries,
                                                "float32"))

    d, x = added(1), np.asarray(x_BTHD).reshape(4, 64, H * D)
    dropped = d == 0
    assert abs(dropped.mean() - rate) < 0.02
    np.testing.assert_allclose(d[~dropped], x[~dropped] / (1 - rate), rtol=1e-5)
    np.testing.assert_array_equal(added(1), d)
    assert not np.array_equal(added(2) == 0, dropped)
