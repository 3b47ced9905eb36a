"""Independent float64 numpy reference for the jaxgpt family of decoder-only transformers.

Why this file exists: the Flax model is checked against this module in tests, so this module must be
derived only from the written specification (and the seed articles it cites), never from the Flax code.
Everything is computed in float64 with plain numpy, deterministically (dropout is always off), so that
any mismatch larger than float32 round-off points at a real bug in one of the two implementations.

Shape suffixes on variable names follow the usual convention:
    B batch, T sequence length, C n_embd, H n_head, D head_dim, F d_ff, V vocab_size, K classes (in
    classifier code) or key/value heads (in attention), G = H / K query heads per key/value head, P rows of a
    position table.
E.g. ``x_BTC`` has shape (B, T, C) and ``att_BHTT`` has shape (B, H, T_query, T_key).

Parameter tree (nested dicts of arrays)::

    {"wte": {"embedding": (V, C)},
     "wpe": {"embedding": (P, C)},                       # position == "learned" only
     "ln_emb": {...},                                    # embd_norm only
     "h_0": {"ln_1": {"scale": (C,), "bias": (C,)},      # "scale" only if norm_scale, "bias" only if use_bias
             "attn": {"qkv": {"kernel": (C, 3, H, D), "bias": (3, H, D)},     # n_kv_head == n_head
                      "q": {"kernel": (C, H, D), "bias": (H, D)},             # n_kv_head = K < n_head:
                      "kv": {"kernel": (C, 2, K, D), "bias": (2, K, D)},      #   separate q and kv
                      "q_norm": {"scale": (D,)}, "k_norm": {"scale": (D,)},  # qk_norm and norm_scale;
                                                                             # (H, D), (K, D) over projections
                      "out": {"kernel": (H, D, C), "bias": (C,)}},
             "ln_2": {...},
             "ln_1_post": {...}, "ln_2_post": {...},     # sandwich_norm only
             "mlp": {"fc": {"kernel": (C, F), "bias": (F,)},
                     "proj": {"kernel": (F, C), "bias": (C,)}}},
     "h_1": ..., ...,
     "ln_f": {...},                                      # final_norm only
     "lm_head": {"kernel": (C, V), "bias": (V,)},        # untied embeddings only
     "cls_head": {"kernel": (C, K), "bias": (K,)}}       # classifier only
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

Params = Mapping[str, Any]
Config = Mapping[str, Any]

POSITION_KINDS = ("learned", "sinusoidal", "sinusoidal_concat", "none")
NORM_KINDS = ("layernorm", "unbiased_std", "rmsnorm")
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "relu2", "silu")

# math.erf applied element-wise: numpy has no erf and scipy is deliberately not a dependency.
_erf = np.vectorize(math.erf, otypes=[np.float64])


# ----------------------------------------------------------------------------------------------------
# Small utilities
# ----------------------------------------------------------------------------------------------------


def to_float64(tree: Any) -> Any:
    """Return a copy of a (nested dict) parameter tree with every leaf as a float64 numpy array.

    The caller may hand us float32 (or jax) arrays; promoting once on entry keeps every later
    computation in float64 so the reference itself contributes no meaningful round-off.
    """
    if isinstance(tree, Mapping):
        return {key: to_float64(value) for key, value in tree.items()}
    return np.array(tree, dtype=np.float64)  # np.array copies, so the caller's arrays are never aliased


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically stable softmax; entries equal to -inf get exactly zero probability.

    Subtracting the (finite) maximum avoids overflow; callers must guarantee at least one finite entry
    along ``axis`` (attention always keeps the diagonal visible, so this holds there).
    """
    shifted = x - np.max(x, axis=axis, keepdims=True)
    unnormalised = np.exp(shifted)
    return unnormalised / np.sum(unnormalised, axis=axis, keepdims=True)


def log_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically stable log-softmax via the log-sum-exp trick."""
    shifted = x - np.max(x, axis=axis, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))


def activation(x: np.ndarray, kind: str) -> np.ndarray:
    """The feed-forward non-linearity.

    "gelu" is the exact Gaussian-CDF form (what torch.nn.GELU computes by default);
    "gelu_tanh" is the tanh approximation popularised by GPT-2.
    """
    if kind == "relu":
        return np.maximum(x, 0.0)
    if kind == "gelu":
        return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))
    if kind == "gelu_tanh":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    if kind == "relu2":  # squared ReLU (So et al., "Primer", 2021)
        return np.where(x > 0.0, x * x, 0.0)
    if kind == "silu":  # x * sigmoid(x), the "swish" of SwiGLU
        return x / (1.0 + np.exp(-x))
    raise ValueError(f"unknown activation {kind!r}; expected one of {ACTIVATIONS}")


def _maybe_bias(value: np.ndarray, layer: Params, use_bias: bool) -> np.ndarray:
    """Add ``layer["bias"]`` only when the config says biases exist (the tree then must contain one)."""
    if use_bias:
        return value + layer["bias"]
    return value


# ----------------------------------------------------------------------------------------------------
# Normalisation
# ----------------------------------------------------------------------------------------------------


def rms_norm(x: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm without its scale (Zhang & Sennrich 2019): x / sqrt(mean(x^2) + eps) over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _scale(p: Params, cfg: Config) -> np.ndarray:
    """The multiplier a stored norm scale w stands for: w, or offset + w with norm_scale_offset (Gemma's 1 + w)."""
    return float(cfg.get("norm_scale_offset", 0.0)) + p["scale"]


def norm(x_BTC: np.ndarray, p: Params, cfg: Config) -> np.ndarray:
    """Normalise over the feature axis, then apply the learned scale (if norm_scale) and bias (if use_bias).

    Three variants exist in the seed material and the 2026 recipes, and give different numbers:
      * "layernorm": standard LayerNorm, biased (population) variance, eps inside the square root.
      * "unbiased_std": the Annotated-Transformer LayerNorm, which uses the unbiased (n-1) standard
        deviation and adds eps to the standard deviation rather than to the variance.
      * "rmsnorm": no centring, divide by the root mean square (`rms_norm`).
    norm_scale=False (nanochat's parameter-free RMSNorm) leaves out the scale.
    """
    kind = cfg["norm"]
    eps = float(cfg["norm_eps"])
    n_features = x_BTC.shape[-1]
    scaled = cfg.get("norm_scale", True)
    if kind == "rmsnorm":
        normed_BTC = rms_norm(x_BTC, eps)
        return _maybe_bias(normed_BTC * _scale(p, cfg) if scaled else normed_BTC, p, bool(cfg["use_bias"]))
    mean_BT1 = np.mean(x_BTC, axis=-1, keepdims=True)
    centred_BTC = x_BTC - mean_BT1
    sum_sq_BT1 = np.sum(centred_BTC**2, axis=-1, keepdims=True)
    if kind == "layernorm":
        var_BT1 = sum_sq_BT1 / n_features
        normed_BTC = centred_BTC / np.sqrt(var_BT1 + eps)
    elif kind == "unbiased_std":
        if n_features < 2:
            raise ValueError("unbiased_std normalisation needs at least 2 features")
        std_BT1 = np.sqrt(sum_sq_BT1 / (n_features - 1))
        normed_BTC = centred_BTC / (std_BT1 + eps)
    else:
        raise ValueError(f"unknown norm {kind!r}; expected one of {NORM_KINDS}")
    return _maybe_bias(normed_BTC * _scale(p, cfg) if scaled else normed_BTC, p, bool(cfg["use_bias"]))


# ----------------------------------------------------------------------------------------------------
# Padding and positions
# ----------------------------------------------------------------------------------------------------


def padding_mask(tokens_BT: np.ndarray, cfg: Config, mask: np.ndarray | None = None) -> np.ndarray:
    """Boolean (B, T): True where the token is padding.

    Padding can be announced two ways and both count: an explicit ``mask`` (False = padding) and,
    if ``pad_id`` is configured, any token equal to it (seed 001 derives padding from pad_id alone).
    """
    is_pad_BT = np.zeros(tokens_BT.shape, dtype=bool)
    if mask is not None:
        mask_BT = np.asarray(mask).astype(bool)
        if mask_BT.shape != tokens_BT.shape:
            raise ValueError(f"mask shape {mask_BT.shape} != tokens shape {tokens_BT.shape}")
        is_pad_BT |= ~mask_BT
    pad_id = cfg.get("pad_id")
    if pad_id is not None:
        is_pad_BT |= tokens_BT == pad_id
    return is_pad_BT


def position_ids(tokens_BT: np.ndarray, cfg: Config, mask: np.ndarray | None = None) -> np.ndarray:
    """Integer (B, T) row indices into the position table.

    Plain scheme: 0, 1, ..., T-1.  With pad_positions (seed 001): the token at index t gets t + 1 and
    every padding token gets 0, so row 0 of the table is reserved for padding.  Note that t + 1 is the
    index in the row, not a count of real tokens, exactly as seed 001 does it.
    """
    batch, seq_len = tokens_BT.shape
    index_BT = np.broadcast_to(np.arange(seq_len), (batch, seq_len))
    if not cfg.get("pad_positions", False):
        return index_BT.copy()
    return np.where(padding_mask(tokens_BT, cfg, mask), 0, index_BT + 1)


def sinusoidal_table(n_pos: int, dim: int, kind: str) -> np.ndarray:
    """Fixed (n_pos, dim) sinusoidal position table.

    Both kinds use the same frequencies, omega_i = 10000 ** (-2 i / dim) for i in [0, dim/2), and differ
    only in where the sin and cos of each frequency go:
      * "sinusoidal" (seed 000, Annotated Transformer): interleaved, column 2i = sin, 2i+1 = cos, with the
        frequency written as exp(-(2i) * ln(10000) / dim).
      * "sinusoidal_concat" (seed 002): all sines first, then all cosines, with the frequency written as
        1 / 10000 ** (i / (dim/2)).
    The two formulas are kept literally as in their sources so that each kind is checked against its
    own recipe.
    """
    if dim % 2 != 0:
        raise ValueError(f"sinusoidal tables need an even dimension, got {dim}")
    half = dim // 2
    pos_P1 = np.arange(n_pos, dtype=np.float64)[:, None]
    if kind == "sinusoidal":
        two_i = np.arange(0, dim, 2, dtype=np.float64)
        freq_half = np.exp(-two_i * math.log(10000.0) / dim)
        angle_Ph = pos_P1 * freq_half[None, :]
        table_PC = np.zeros((n_pos, dim), dtype=np.float64)
        table_PC[:, 0::2] = np.sin(angle_Ph)
        table_PC[:, 1::2] = np.cos(angle_Ph)
        return table_PC
    if kind == "sinusoidal_concat":
        depth = float(half)
        rate_half = 1.0 / (10000.0 ** (np.arange(half, dtype=np.float64) / depth))
        angle_Ph = pos_P1 * rate_half[None, :]
        return np.concatenate([np.sin(angle_Ph), np.cos(angle_Ph)], axis=-1)
    raise ValueError(f"unknown sinusoidal kind {kind!r}")


def embed(params: Params, tokens_BT: np.ndarray, cfg: Config, mask: np.ndarray | None = None) -> np.ndarray:
    """Token embedding (optionally times sqrt(C), as in seeds 000/002) plus the positional term."""
    n_embd = int(cfg["n_embd"])
    x_BTC = params["wte"]["embedding"][tokens_BT]
    if cfg.get("scale_embeddings", False):
        x_BTC = x_BTC * math.sqrt(n_embd)
    kind = cfg["position"]
    if kind == "none":
        return x_BTC
    pos_BT = position_ids(tokens_BT, cfg, mask)
    if kind == "learned":
        table_PC = params["wpe"]["embedding"]
    elif kind in ("sinusoidal", "sinusoidal_concat"):
        table_PC = sinusoidal_table(int(pos_BT.max()) + 1, n_embd, kind)
    else:
        raise ValueError(f"unknown position kind {kind!r}; expected one of {POSITION_KINDS}")
    if pos_BT.max() >= table_PC.shape[0]:
        raise ValueError(f"position {pos_BT.max()} out of range for a table with {table_PC.shape[0]} rows")
    return x_BTC + table_PC[pos_BT]


# ----------------------------------------------------------------------------------------------------
# Attention, MLP, blocks
# ----------------------------------------------------------------------------------------------------


def attention_visibility(is_pad_BT: np.ndarray) -> np.ndarray:
    """Boolean (B, T_query, T_key): may query i look at key j?

    Rule: j <= i (causal) and (key j is real or j == i).  Keeping the diagonal always visible means no
    row is ever fully masked, so softmax never divides by zero and never spreads a padded query's mass
    uniformly over future positions (which is what a finite -1e9 fill does in seed 001).
    """
    seq_len = is_pad_BT.shape[1]
    causal_TT = np.tril(np.ones((seq_len, seq_len), dtype=bool))
    diagonal_TT = np.eye(seq_len, dtype=bool)
    key_real_B1T = ~is_pad_BT[:, None, :]
    return causal_TT[None] & (key_real_B1T | diagonal_TT[None])


def is_local_layer(layer: int, cfg: Config) -> bool:
    """Whether layer `layer` attends within a sliding window: all layers when sliding_window is set without a
    window_pattern N; with one, all but the layers numbered N, 2N, ... counting from 1 (Gemma 3: 5 local, 1
    global)."""
    if cfg.get("sliding_window") is None:
        return False
    pattern = cfg.get("window_pattern")
    return pattern is None or (layer + 1) % int(pattern) != 0


def window_visibility(visible_BTT: np.ndarray, window: int) -> np.ndarray:
    """A local layer's visibility: the causal one, restricted to the `window` most recent keys (the query's own
    included), key j visible to query i only if i - j < window."""
    seq_len = visible_BTT.shape[1]
    distance_TT = np.arange(seq_len)[:, None] - np.arange(seq_len)[None, :]
    return visible_BTT & (distance_TT < window)[None]


def rope_omegas(cfg: Config, local: bool) -> tuple[np.ndarray, float]:
    """The angular speed of each rotated pair (D/2,) and the factor on the rotated vectors (YaRN's "mscale").

    Plain RoPE: omega_i = theta ** (-2 i / D). A local layer with rope_local_theta uses that base, unscaled.
    Otherwise rope_scaling stretches the wavelengths 2 pi / omega_i for contexts rope_factor times longer:
      * "linear" (position interpolation): every omega divided by the factor.
      * "llama3": wavelengths shorter than original / high_freq_factor kept, longer than original /
        low_freq_factor divided by the factor, and in between a mix whose weight on the unscaled omega grows
        linearly with original / wavelength from low_freq_factor (weight 0) to high_freq_factor (weight 1).
      * "yarn" (Peng et al. 2023, "NTK-by-parts"): pair i makes r_i = original * omega_i / (2 pi) turns over the
        original context; pairs turning more than beta_fast times keep omega, fewer than beta_slow times are
        divided by the factor, and between them the weight of the unscaled omega ramps linearly in i between
        the pair indices where r = beta_fast and r = beta_slow (rounded outward to whole pairs, clipped to
        [0, D - 1]); the rotated vectors are multiplied by attention_factor, by default 1 + 0.1 ln(factor).
    """
    dim = int(cfg["head_dim"])
    pair_h = np.arange(dim // 2, dtype=np.float64)
    use_local = local and cfg.get("rope_local_theta") is not None
    theta = float(cfg["rope_local_theta"] if use_local else cfg["rope_theta"])
    omega_h = theta ** (-2.0 * pair_h / dim)
    kind = None if use_local else cfg.get("rope_scaling")
    factor = float(cfg.get("rope_factor", 1.0))
    if kind is None:
        return omega_h, 1.0
    if kind == "linear":
        return omega_h / factor, 1.0
    original = float(cfg["rope_original_positions"])
    if kind == "llama3":
        low, high = float(cfg["rope_low_freq_factor"]), float(cfg["rope_high_freq_factor"])
        wavelength_h = 2.0 * math.pi / omega_h
        out_h = np.empty_like(omega_h)
        for i, (omega, wavelength) in enumerate(zip(omega_h, wavelength_h, strict=True)):
            if wavelength < original / high:
                out_h[i] = omega
            elif wavelength > original / low:
                out_h[i] = omega / factor
            else:
                weight = (original / wavelength - low) / (high - low)
                out_h[i] = weight * omega + (1.0 - weight) * omega / factor
        return out_h, 1.0
    if kind == "yarn":
        def pair_turning(turns: float) -> float:  # solve original * theta ** (-2 i / D) / (2 pi) = turns for i
            return dim * math.log(original / (2.0 * math.pi * turns)) / (2.0 * math.log(theta))
        first = max(math.floor(pair_turning(float(cfg["rope_beta_fast"]))), 0)
        last = min(math.ceil(pair_turning(float(cfg["rope_beta_slow"]))), dim - 1)
        span = last - first if last != first else 0.001
        interpolated_weight_h = np.minimum(np.maximum((pair_h - first) / span, 0.0), 1.0)
        omega_h = interpolated_weight_h * omega_h / factor + (1.0 - interpolated_weight_h) * omega_h
        attention_factor = cfg.get("rope_attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 + 0.1 * math.log(factor) if factor > 1 else 1.0
        return omega_h, float(attention_factor)
    raise ValueError(f"unknown rope_scaling {kind!r}")


def rotary(x_BTHD: np.ndarray, theta: float | tuple[np.ndarray, float]) -> np.ndarray:
    """Rotary position embedding (Su et al., RoFormer) of the token at index t of its row.

    Each head's dimension pair (i, i + D/2) is read as the complex number x_i + 1j x_{i+D/2} and multiplied by
    e^{1j t omega_i} with omega_i = theta ** (-2 i / D): a rotation by the angle t omega_i. `theta` may instead
    be (omegas, factor) from `rope_omegas`, the rotated vector then scaled by the factor.
    """
    seq_len, dim = x_BTHD.shape[1], x_BTHD.shape[-1]
    half = dim // 2
    if isinstance(theta, tuple):
        omega_h, factor = theta
    else:
        omega_h, factor = theta ** (-2.0 * np.arange(half, dtype=np.float64) / dim), 1.0
    z_BTHh = x_BTHD[..., :half] + 1j * x_BTHD[..., half:]
    z_BTHh = factor * z_BTHh * np.exp(1j * np.arange(seq_len)[:, None] * omega_h)[None, :, None, :]
    return np.concatenate([z_BTHh.real, z_BTHh.imag], axis=-1)


def _qk_norm(x_BTHD: np.ndarray, p: Params, cfg: Config) -> np.ndarray:
    """QK-norm: RMSNorm of each head's vector over D, times a learned (D,) scale if norm_scale; no bias. At
    qk_norm_site "projection" (OLMo 2) the RMS is over all heads' H * D values of a token at once, and the scale
    is (H, D)."""
    eps = float(cfg["norm_eps"])
    if cfg.get("qk_norm_site", "after_rope") == "projection":
        B, T, H, D = x_BTHD.shape
        normed = rms_norm(x_BTHD.reshape(B, T, H * D), eps).reshape(B, T, H, D)
    else:
        normed = rms_norm(x_BTHD, eps)
    return normed * _scale(p, cfg) if cfg.get("norm_scale", True) else normed


def attention(
    x_BTC: np.ndarray, p: Params, visible_BTT: np.ndarray, cfg: Config, local: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Multi-head scaled dot-product self-attention.

    Returns (output_BTC, probabilities_BHTT).  Heads have their own size D = head_dim, which need not
    equal C / H (seed 004's Keras layer sets a per-head key_dim independently of the model width).
    With n_kv_head = K < H (grouped-query attention) the keys and values have K heads and query head h
    reads key/value head h // (H / K). Rotary positions (rope_theta) rotate queries and keys, then
    QK-norm (qk_norm) normalises them: nanochat's order; qk_norm_site "before_rope" or "projection" normalises
    them first. The q, k and v projections have biases if qkv_bias says so (None: as use_bias). Scores are
    q.k times query_scale (default 1/sqrt(D)), then squashed to attn_softcap * tanh(s / attn_softcap) if set,
    then masked. A `local` layer (sliding window) sees only its window and rotates with `rope_omegas`' local
    frequencies.
    """
    use_bias = bool(cfg["use_bias"])
    qkv_bias = use_bias if cfg.get("qkv_bias") is None else bool(cfg["qkv_bias"])
    head_dim = int(cfg["head_dim"])
    if "qkv" in p:
        qkv_3BTHD = np.einsum("btc,cshd->sbthd", x_BTC, p["qkv"]["kernel"])
        if qkv_bias:
            qkv_3BTHD = qkv_3BTHD + p["qkv"]["bias"][:, None, None, :, :]
        q_BTHD, k_BTKD, v_BTKD = qkv_3BTHD[0], qkv_3BTHD[1], qkv_3BTHD[2]
    else:
        q_BTHD = _maybe_bias(np.einsum("btc,chd->bthd", x_BTC, p["q"]["kernel"]), p["q"], qkv_bias)
        kv_2BTKD = np.einsum("btc,cskd->sbtkd", x_BTC, p["kv"]["kernel"])
        if qkv_bias:
            kv_2BTKD = kv_2BTKD + p["kv"]["bias"][:, None, None, :, :]
        k_BTKD, v_BTKD = kv_2BTKD[0], kv_2BTKD[1]
    norm_late = cfg.get("qk_norm_site", "after_rope") == "after_rope"
    if cfg.get("qk_norm", False) and not norm_late:
        q_BTHD, k_BTKD = _qk_norm(q_BTHD, p.get("q_norm"), cfg), _qk_norm(k_BTKD, p.get("k_norm"), cfg)
    if cfg.get("rope_theta"):
        omegas = rope_omegas(cfg, local)
        q_BTHD, k_BTKD = rotary(q_BTHD, omegas), rotary(k_BTKD, omegas)
    if cfg.get("qk_norm", False) and norm_late:
        q_BTHD, k_BTKD = _qk_norm(q_BTHD, p.get("q_norm"), cfg), _qk_norm(k_BTKD, p.get("k_norm"), cfg)
    group = q_BTHD.shape[2] // k_BTKD.shape[2]
    k_BTHD, v_BTHD = np.repeat(k_BTKD, group, axis=2), np.repeat(v_BTKD, group, axis=2)

    query_scale = cfg.get("query_scale")
    query_scale = 1.0 / math.sqrt(head_dim) if query_scale is None else float(query_scale)
    scores_BHTT = np.einsum("bqhd,bkhd->bhqk", q_BTHD, k_BTHD) * query_scale
    cap = cfg.get("attn_softcap")
    if cap is not None:
        scores_BHTT = cap * np.tanh(scores_BHTT / cap)
    if local:
        visible_BTT = window_visibility(visible_BTT, int(cfg["sliding_window"]))
    scores_BHTT = np.where(visible_BTT[:, None, :, :], scores_BHTT, -np.inf)
    att_BHTT = softmax(scores_BHTT, axis=-1)

    y_BTHD = np.einsum("bhqk,bkhd->bqhd", att_BHTT, v_BTHD)
    out_BTC = np.einsum("bthd,hdc->btc", y_BTHD, p["out"]["kernel"])
    return _maybe_bias(out_BTC, p["out"], use_bias), att_BHTT


def mlp(x_BTC: np.ndarray, p: Params, cfg: Config) -> np.ndarray:
    """Position-wise feed-forward network: proj(act(fc(x))), or gated proj(act(gate(x)) * fc(x))."""
    use_bias = bool(cfg["use_bias"])
    hidden_BTF = _maybe_bias(x_BTC @ p["fc"]["kernel"], p["fc"], use_bias)
    if cfg.get("gated_mlp"):
        hidden_BTF = activation(_maybe_bias(x_BTC @ p["gate"]["kernel"], p["gate"], use_bias),
                                cfg["activation"]) * hidden_BTF
    else:
        hidden_BTF = activation(hidden_BTF, cfg["activation"])
    return _maybe_bias(hidden_BTF @ p["proj"]["kernel"], p["proj"], use_bias)


def block(
    x_BTC: np.ndarray, p: Params, visible_BTT: np.ndarray, cfg: Config, local: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """One transformer layer; returns (new x_BTC, attention probabilities_BHTT).

    "pre" (GPT-2, seed 000): normalise the input of each sub-layer, residual stays un-normalised; with
    sandwich_norm (Gemma 2/3) each sub-layer's output is normalised too (ln_1_post, ln_2_post) before the add.
    "post" (GPT-1, seeds 001/004): add the residual first, then normalise the sum.
    """
    placement = cfg["norm_placement"]
    if placement == "pre":
        sandwich = cfg.get("sandwich_norm", False)
        att_out_BTC, att_BHTT = attention(norm(x_BTC, p.get("ln_1", {}), cfg), p["attn"], visible_BTT, cfg, local)
        if sandwich:
            att_out_BTC = norm(att_out_BTC, p.get("ln_1_post", {}), cfg)
        x_BTC = x_BTC + att_out_BTC
        mlp_out_BTC = mlp(norm(x_BTC, p.get("ln_2", {}), cfg), p["mlp"], cfg)
        if sandwich:
            mlp_out_BTC = norm(mlp_out_BTC, p.get("ln_2_post", {}), cfg)
        x_BTC = x_BTC + mlp_out_BTC
    elif placement == "post":
        att_out_BTC, att_BHTT = attention(x_BTC, p["attn"], visible_BTT, cfg, local)
        x_BTC = norm(x_BTC + att_out_BTC, p.get("ln_1", {}), cfg)
        x_BTC = norm(x_BTC + mlp(x_BTC, p["mlp"], cfg), p.get("ln_2", {}), cfg)
    else:
        raise ValueError(f"unknown norm_placement {placement!r}; expected 'pre' or 'post'")
    return x_BTC, att_BHTT


# ----------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------


def _check_tokens(tokens: np.ndarray, cfg: Config) -> np.ndarray:
    """Validate the token batch: 2-D integers, in vocabulary, no longer than the context window."""
    tokens_BT = np.asarray(tokens)
    if tokens_BT.ndim != 2 or not np.issubdtype(tokens_BT.dtype, np.integer):
        raise ValueError(f"tokens must be an integer (B, T) array, got {tokens_BT.dtype} {tokens_BT.shape}")
    if tokens_BT.shape[1] > int(cfg["block_size"]):
        raise ValueError(f"sequence length {tokens_BT.shape[1]} exceeds block_size {cfg['block_size']}")
    if tokens_BT.size and (tokens_BT.min() < 0 or tokens_BT.max() >= int(cfg["vocab_size"])):
        raise ValueError("token id out of vocabulary range")
    return tokens_BT


def hidden_states(
    params: Params, tokens: np.ndarray, cfg: Config, mask: np.ndarray | None = None
) -> tuple[np.ndarray, list[np.ndarray]]:
    """Run embedding + all layers (+ final norm). Returns (h_BTC, per-layer attention probabilities)."""
    params = to_float64(params)
    tokens_BT = _check_tokens(tokens, cfg)
    visible_BTT = attention_visibility(padding_mask(tokens_BT, cfg, mask))
    x_BTC = embed(params, tokens_BT, cfg, mask)
    if cfg.get("embd_norm", False):
        x_BTC = norm(x_BTC, params.get("ln_emb", {}), cfg)
    attentions: list[np.ndarray] = []
    for layer in range(int(cfg["n_layer"])):
        x_BTC, att_BHTT = block(x_BTC, params[f"h_{layer}"], visible_BTT, cfg, is_local_layer(layer, cfg))
        attentions.append(att_BHTT)
    if cfg["final_norm"]:
        x_BTC = norm(x_BTC, params.get("ln_f", {}), cfg)
    return x_BTC, attentions


def lm_logits(params: Params, h_BTC: np.ndarray, cfg: Config) -> np.ndarray:
    """Vocabulary logits from final hidden states: tied (h @ wte^T, no bias) or a separate lm_head.

    With logit_softcap = c they are squashed into (-c, c): c * tanh(logits / c) (Gemma 2, nanochat).
    """
    params = to_float64(params)
    if cfg["tie_embeddings"]:
        logits_BTV = h_BTC @ params["wte"]["embedding"].T
    else:
        head = params["lm_head"]
        logits_BTV = _maybe_bias(h_BTC @ head["kernel"], head, bool(cfg["use_bias"]))
    cap = cfg.get("logit_softcap")
    return logits_BTV if cap is None else cap * np.tanh(logits_BTV / cap)


def forward(
    params: Params, tokens: np.ndarray, cfg: Config, mask: np.ndarray | None = None
) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
    """Full language-model pass.

    Returns (logits_BTV, [attention probabilities (B, H, T, T) per layer], final hidden states h_BTC).
    """
    params = to_float64(params)
    h_BTC, attentions = hidden_states(params, tokens, cfg, mask)
    return lm_logits(params, h_BTC, cfg), attentions, h_BTC


def log_probs(params: Params, tokens: np.ndarray, cfg: Config, mask: np.ndarray | None = None) -> np.ndarray:
    """log_softmax of the logits over the vocabulary, (B, T, V) (what seed 000's Generator returns)."""
    logits_BTV, _, _ = forward(params, tokens, cfg, mask)
    return log_softmax(logits_BTV, axis=-1)


def loss(
    params: Params,
    tokens: np.ndarray,
    targets: np.ndarray,
    cfg: Config,
    mask: np.ndarray | None = None,
) -> float:
    """Mean next-token cross-entropy over all B*T positions (padding positions are not excluded).

    ``targets[b, t]`` is the token that should follow ``tokens[b, : t + 1]``.
    """
    logp_BTV = log_probs(params, tokens, cfg, mask)
    targets_BT = np.asarray(targets)
    if targets_BT.shape != logp_BTV.shape[:2]:
        raise ValueError(f"targets shape {targets_BT.shape} != tokens shape {logp_BTV.shape[:2]}")
    picked_BT = np.take_along_axis(logp_BTV, targets_BT[..., None].astype(np.int64), axis=-1)[..., 0]
    return float(-np.mean(picked_BT))


def classifier_forward(
    params: Params,
    tokens: np.ndarray,
    cfg: Config,
    cls_token_id: int,
    mask: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """GPT-1 style LM + classification heads (seed 001's GPTClsHead). Returns (lm_logits_BTV, cls_logits_BK).

    Each row is classified from the hidden state at the LAST position holding ``cls_token_id``.  The
    classification bias is added when the tree has one (seed 001's classifier is a biased nn.Linear).
    """
    params = to_float64(params)
    tokens_BT = _check_tokens(tokens, cfg)
    logits_BTV, _, h_BTC = forward(params, tokens_BT, cfg, mask)
    is_cls_BT = tokens_BT == cls_token_id
    if not np.all(is_cls_BT.any(axis=1)):
        raise ValueError(f"every row must contain cls_token_id={cls_token_id}")
    seq_len = tokens_BT.shape[1]
    last_cls_B = seq_len - 1 - np.argmax(is_cls_BT[:, ::-1], axis=1)
    pooled_BC = h_BTC[np.arange(tokens_BT.shape[0]), last_cls_B]
    head = params["cls_head"]
    cls_logits_BK = pooled_BC @ head["kernel"]
    if "bias" in head:
        cls_logits_BK = cls_logits_BK + head["bias"]
    return logits_BTV, cls_logits_BK


# ----------------------------------------------------------------------------------------------------
# Parameter construction (for tests of this module and as a layout oracle)
# ----------------------------------------------------------------------------------------------------


def position_table_rows(cfg: Config) -> int:
    """Rows of the learned position table: block_size, plus one reserved padding row if pad_positions."""
    return int(cfg["block_size"]) + (1 if cfg.get("pad_positions", False) else 0)


def random_params(cfg: Config, seed: int = 0, n_classes: int | None = None, std: float = 0.5) -> dict:
    """Random float64 parameters in the documented tree layout (norm scales around 1).

    ``std`` is deliberately large compared with usual GPT initialisation so that every term (biases,
    positions, every layer) visibly influences the outputs in tests.
    """
    rng = np.random.default_rng(seed)
    n_embd, n_head, head_dim = int(cfg["n_embd"]), int(cfg["n_head"]), int(cfg["head_dim"])
    n_kv_head = int(cfg.get("n_kv_head") or n_head)
    d_ff, vocab = int(cfg["d_ff"]), int(cfg["vocab_size"])
    use_bias, scaled = bool(cfg["use_bias"]), bool(cfg.get("norm_scale", True))
    qkv_bias = use_bias if cfg.get("qkv_bias") is None else bool(cfg["qkv_bias"])
    offset = float(cfg.get("norm_scale_offset", 0.0))

    def normal(*shape: int) -> np.ndarray:
        return rng.normal(0.0, std, size=shape)

    def dense(*shape: int, bias_shape: tuple[int, ...], biased: bool = use_bias) -> dict:
        layer = {"kernel": normal(*shape)}
        if biased:
            layer["bias"] = normal(*bias_shape)
        return layer

    def norm_params(*width: int, bias: bool = True) -> dict:  # stored w = the scale (around 1) minus the offset
        layer = {"scale": 1.0 - offset + normal(*(width or (n_embd,)))} if scaled else {}
        if use_bias and bias:
            layer["bias"] = normal(*(width or (n_embd,)))
        return layer

    def attention_params() -> dict:
        if n_kv_head == n_head:
            attn = {"qkv": dense(n_embd, 3, n_head, head_dim, bias_shape=(3, n_head, head_dim), biased=qkv_bias)}
        else:
            attn = {"q": dense(n_embd, n_head, head_dim, bias_shape=(n_head, head_dim), biased=qkv_bias),
                    "kv": dense(n_embd, 2, n_kv_head, head_dim, bias_shape=(2, n_kv_head, head_dim), biased=qkv_bias)}
        if cfg.get("qk_norm", False) and cfg.get("qk_norm_site", "after_rope") == "projection":
            attn["q_norm"] = norm_params(n_head, head_dim, bias=False)
            attn["k_norm"] = norm_params(n_kv_head, head_dim, bias=False)
        elif cfg.get("qk_norm", False):
            attn["q_norm"], attn["k_norm"] = norm_params(head_dim, bias=False), norm_params(head_dim, bias=False)
        attn["out"] = dense(n_head, head_dim, n_embd, bias_shape=(n_embd,))
        return attn

    params: dict[str, Any] = {"wte": {"embedding": normal(vocab, n_embd)}}
    if cfg["position"] == "learned":
        params["wpe"] = {"embedding": normal(position_table_rows(cfg), n_embd)}
    if cfg.get("embd_norm", False):
        params["ln_emb"] = norm_params()
    for layer in range(int(cfg["n_layer"])):
        params[f"h_{layer}"] = {
            "ln_1": norm_params(),
            "attn": attention_params(),
            "ln_2": norm_params(),
            "mlp": {
                "fc": dense(n_embd, d_ff, bias_shape=(d_ff,)),
                "proj": dense(d_ff, n_embd, bias_shape=(n_embd,)),
                **({"gate": dense(n_embd, d_ff, bias_shape=(d_ff,))} if cfg.get("gated_mlp") else {}),
            },
        }
        if cfg.get("sandwich_norm", False):
            params[f"h_{layer}"]["ln_1_post"], params[f"h_{layer}"]["ln_2_post"] = norm_params(), norm_params()
    if cfg["final_norm"]:
        params["ln_f"] = norm_params()
    if not cfg["tie_embeddings"]:
        params["lm_head"] = dense(n_embd, vocab, bias_shape=(vocab,))
    if n_classes is not None:
        params["cls_head"] = {"kernel": normal(n_embd, n_classes), "bias": normal(n_classes)}
    return _without_empty(params)


def _without_empty(tree: dict) -> dict:
    """The tree without empty sub-trees: a parameter-free norm has no entry at all (as in Flax)."""
    pruned = {key: _without_empty(value) if isinstance(value, dict) else value for key, value in tree.items()}
    return {key: value for key, value in pruned.items() if not (isinstance(value, dict) and not value)}
