"""Tiny models for tests: presets shrunk to test size, random weights, the float64 reference comparison, the
2026 options, and run directories written as the trainer leaves them (no training)."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import numpy_reference as ref

from jaxgpt.data.tokenizer import CharTokenizer
from jaxgpt.errors import UserError
from jaxgpt.generate.text_stream import Decodes
from jaxgpt.io.checkpoint import Checkpointer
from jaxgpt.model.config import ModelConfig
from jaxgpt.model.gpt import GPT, GPTClassifier, init_params, stack_layers
from jaxgpt.model.presets import get_preset
from jaxgpt.train.optim import OptimConfig, make_optimizer

TINY = dict(vocab_size=61, block_size=16, n_layer=2, n_embd=32, n_head=4, d_ff=48)


def shrink(cfg: ModelConfig, **changes) -> ModelConfig:
    """A preset at test size, keeping every architectural choice (including head_dim = n_embd, and grouped-query
    attention: 2 key/value heads for the 4 query heads)."""
    head_dim = TINY["n_embd"] if cfg.head_dim == cfg.n_embd else None
    n_kv_head = None if cfg.is_derived("n_kv_head") else 2
    return cfg.replace(**{**TINY, "head_dim": head_dim, "n_kv_head": n_kv_head,
                          "pad_id": None if cfg.pad_id is None else 0, **changes})


@functools.cache
def random_params(cfg: ModelConfig, seed: int = 0, std: float = 0.3) -> dict:
    """The float64 reference's random weights in float32 (std 0.3: the logits are far from uniform and greedy
    choices clear; the comparisons with transformers take 0.05), stacked where the layers are scanned, built with
    numpy (jitting `init_params` for every small test would cost seconds each).

    Committed to the device like restored checkpoints, so the CLI tests reuse the library tests' compilations.
    """
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), ref.random_params(cfg.to_dict(), seed=seed, std=std))
    params = stack_layers(params, cfg.n_layer) if cfg.scan_layers else params
    return jax.device_put(params, jax.sharding.SingleDeviceSharding(jax.devices()[0]))


def prompts(cfg: ModelConfig, length: int, batch: int = 2, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, cfg.vocab_size, size=(batch, length))  # 1..: never the pad id


def bpe_or_skip():
    from jaxgpt.data.tokenizer import load_bpe

    try:
        return load_bpe()
    except UserError as e:
        pytest.skip(f"GPT-2 BPE ranks unavailable: {e}")


class CountingDecodes:
    """A tokenizer that counts the ids it is asked to decode."""

    def __init__(self, tokenizer: Decodes) -> None:
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids: list[int]) -> str:
        self.decoded += len(ids)
        return self.tokenizer.decode(ids)


def save_run(workdir: Path, cfg: ModelConfig, params: dict, tokenizer_meta: dict) -> Path:
    """A work directory with one checkpoint, written with the trainer's checkpointer."""
    ckpt = Checkpointer(workdir)
    ckpt.save({"params": params, "opt_state": {"count": jnp.zeros((), jnp.int32)}, "step": 1},
              {"model": cfg.to_dict(), "tokenizer": tokenizer_meta, "val_loss": 1.0})
    ckpt.wait()
    ckpt.close()
    return workdir


def save_random_lm(workdir: Path, cfg: ModelConfig, tok: CharTokenizer) -> None:
    """A language-model run directory as train.py leaves it, with random weights (fast, no training)."""
    params = init_params(cfg, jax.random.key(0), GPT(cfg))
    state = {"params": params, "opt_state": make_optimizer(OptimConfig()).init(params), "step": jnp.asarray(1)}
    ckpt = Checkpointer(workdir)
    ckpt.save(state, {"model": cfg.to_dict(), "tokenizer": tok.to_meta()})
    ckpt.wait()
    ckpt.close()


def assert_trees_equal(a: dict, b: dict) -> None:
    flat_a = jax.tree_util.tree_leaves_with_path(a)
    flat_b = jax.tree_util.tree_leaves_with_path(b)
    assert [p for p, _ in flat_a] == [p for p, _ in flat_b]
    for (path, x), (_, y) in zip(flat_a, flat_b, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype, path
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))


@functools.cache
def jit_apply(cfg: ModelConfig, classifier: bool = False):
    model = GPTClassifier(cfg, n_class=3, cls_token_id=7) if classifier else GPT(cfg)

    @jax.jit
    def run(params, idx, mask):
        out, state = model.apply({"params": params}, idx, mask, mutable=["intermediates"])
        return out, state.get("intermediates", {})

    return run


def attn_weights(cfg: ModelConfig, intermediates: dict) -> list[np.ndarray]:
    if cfg.scan_layers:
        stacked = intermediates["h"]["attn"]["attn_weights"][0]
        return [np.asarray(stacked[i]) for i in range(cfg.n_layer)]
    return [np.asarray(intermediates[f"h_{i}"]["attn"]["attn_weights"][0]) for i in range(cfg.n_layer)]


def to_jax(params: dict) -> dict:
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)


def sample_inputs(cfg: ModelConfig, seed: int, padded: bool, batch: int = 3) -> tuple[np.ndarray, np.ndarray | None]:
    rng = np.random.default_rng(seed)
    T = cfg.block_size
    idx = rng.integers(1, cfg.vocab_size, size=(batch, T))
    if not padded:
        return idx, None
    mask = np.ones((batch, T), bool)
    mask[0, :5] = False  # left padding
    mask[1, -4:] = False  # right padding
    mask[2] = rng.random(T) > 0.3  # scattered
    if cfg.pad_id is not None:
        idx = np.where(mask, idx, cfg.pad_id)
    return idx, mask


def assert_matches_reference(cfg: ModelConfig, seed: int, padded: bool) -> None:
    params64 = ref.random_params(cfg.to_dict(), seed=seed, std=0.3)
    idx, mask = sample_inputs(cfg, seed, padded)
    params = to_jax(params64)
    if cfg.scan_layers:
        params = stack_layers(params, cfg.n_layer)
    logits, inter = jit_apply(cfg)(params, jnp.asarray(idx), None if mask is None else jnp.asarray(mask))
    want, want_attn, _ = ref.forward(params64, idx, cfg.to_dict(), mask)
    scale = max(1.0, np.abs(want).max())
    np.testing.assert_allclose(np.asarray(logits), want, rtol=0, atol=1e-5 * scale)
    if cfg.attention_impl == "einsum":
        for got_l, want_l in zip(attn_weights(cfg, inter), want_attn, strict=True):
            np.testing.assert_allclose(got_l, want_l, rtol=0, atol=1e-5)


MODERN = {
    "rotary": dict(position="none", rope_theta=1000.0),
    "rmsnorm": dict(norm="rmsnorm"),
    "rmsnorm-no-scale": dict(norm="rmsnorm", norm_scale=False),
    "embd-norm": dict(embd_norm=True),
    "qk-norm": dict(qk_norm=True),
    "relu2": dict(activation="relu2"),
    "no-bias": dict(use_bias=False),
    "softcap": dict(logit_softcap=2.0),
    "gqa": dict(n_kv_head=2),
    "mqa": dict(n_kv_head=1),
    "swiglu": dict(gated_mlp=True, activation="silu"),
    "geglu": dict(gated_mlp=True, activation="gelu_tanh", use_bias=True),
    # the open-weight architectures' knobs (issue 62), each alone on GPT-2 (16 positions)
    "qkv-bias": dict(use_bias=False, qkv_bias=True),
    "qk-norm-before-rope": dict(position="none", rope_theta=1000.0, qk_norm=True, qk_norm_site="before_rope"),
    "qk-norm-projection": dict(position="none", rope_theta=1000.0, qk_norm=True, qk_norm_site="projection"),
    "norm-offset": dict(norm="rmsnorm", norm_scale_offset=1.0),
    "sandwich-norm": dict(sandwich_norm=True),
    "scale-embeddings": dict(scale_embeddings=True),
    "attn-softcap": dict(attn_softcap=1.0),
    "query-scale": dict(query_scale=0.7),
    "sliding-window": dict(sliding_window=4),
    "rope-linear": dict(position="none", rope_theta=1000.0, rope_scaling="linear", rope_factor=4.0),
}

# Rotary at base 1000 over head_dim 8 turns its 4 pairs at wavelengths 6, 35, 199 and 1117 positions: against 64
# original positions llama3 keeps the first, blends the second and slows the others 8 times; yarn (factor 4)
# ramps pairs 0-2 (its beta_fast / beta_slow pair indices round to 0 and 2), and multiplies cos and sin by 1.14.
_OPEN = dict(block_size=64, n_kv_head=2, norm_scale=True, gated_mlp=True, activation="silu", embd_norm=False,
             qk_norm=False, logit_softcap=None)
_LONG_ROPE = dict(rope_theta=1000.0, rope_original_positions=64)
# Gemma 3's set on 64 positions: (1 + w) norms around each sub-layer, QK-norm before the rotary, a query scale,
# local layers (window 8, base 100, unscaled) then global ones (nanochat's base, linear scaling), embeddings times
# sqrt(C), GeGLU, and Gemma 2's attention soft-cap.
_GEMMA3 = dict(_OPEN, activation="gelu_tanh", norm_scale_offset=1.0, sandwich_norm=True, qk_norm=True,
               qk_norm_site="before_rope", query_scale=0.3, sliding_window=8, window_pattern=2, rope_local_theta=100.0,
               rope_scaling="linear", rope_factor=4.0, scale_embeddings=True, attn_softcap=2.0, tie_embeddings=True)


# nanochat's full set (shrunk), with grouped queries, scanned layers and XLA's attention too; rotary then a
# scaled QK-norm (the order matters only with a scale); GQA with rotary (padded inputs below).
MODERN_COMBOS = {
    "nanochat": {},
    "nanochat-gqa-scan-xla": dict(n_kv_head=2, scan_layers=True, attention_impl="xla"),
    "rotary-qk-norm-scaled": dict(norm_scale=True),
    "gqa-rotary": dict(n_kv_head=2, qk_norm=False, embd_norm=False, norm="layernorm", norm_scale=True,
                       use_bias=True, activation="gelu_tanh", logit_softcap=None),
    # open-weight families (issue 62); the scanned Gemma alternates local and global layers under one nn.scan
    "gemma3-like": _GEMMA3,
    "gemma3-like-scan-remat": dict(_GEMMA3, scan_layers=True, remat="full"),
    "mistral-like-xla": dict(_OPEN, sliding_window=8, attention_impl="xla", query_scale=0.2),
    "qwen2-like": dict(_OPEN, qkv_bias=True),
    "llama3-like": dict(_OPEN, **_LONG_ROPE, rope_scaling="llama3", rope_factor=8.0),
    "yarn": dict(_OPEN, **_LONG_ROPE, rope_scaling="yarn", rope_factor=4.0),
    "olmo-like": dict(_OPEN, qk_norm=True, qk_norm_site="projection"),
}


def modern(name: str) -> ModelConfig:
    """A tiny model with one option (`MODERN`) on top of GPT-2, or a variant of shrunk nanochat-d12."""
    if name in MODERN:
        return shrink(get_preset("gpt2")).replace(**MODERN[name])
    return shrink(get_preset("nanochat-d12")).replace(**MODERN_COMBOS[name])


# The options that act across positions (attention, the cache), and the combinations, which hold every option;
# the others act on each position alone, and padding can change nothing for them that the combinations miss.
ACROSS_POSITIONS = ["rotary", "qk-norm", "gqa", "mqa", "sliding-window", *MODERN_COMBOS]
