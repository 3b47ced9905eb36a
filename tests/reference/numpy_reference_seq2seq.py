"""Independent float64 numpy reference for the encoder-decoder Transformer (seeds 000 and 002).

It extends `numpy_reference` (whose norm, feed-forward, position tables and self-attention it reuses) with
what only an encoder-decoder has, written from the articles, never from the Flax code:

* The encoder (seed 002's Encoder, the Annotated Transformer's): token embedding (times sqrt(C) when
  configured) plus positions 0..S-1, then layers of unmasked self-attention and feed-forward. A source
  token equal to pad_id (seed 002's mask_zero) or masked out is hidden as a key; a padding query still
  looks at the real keys (the Annotated Transformer's src_mask hides keys only).
* The decoder: the same embedding of the target prefix, then layers of masked self-attention (causal; a
  padding key hidden except from itself, as in `numpy_reference.attention_visibility`), cross-attention
  whose queries come from the decoder and whose keys and values come from the encoder output (padding
  source positions hidden), and feed-forward.
* Each sub-layer is x + f(norm(x)) ("pre", the Annotated Transformer's SublayerConnection) or
  norm(x + f(x)) ("post", seed 002's Add & Norm); with final_norm each stack ends in a norm.
* Logits: the target embedding transposed (tie_embeddings) or a separate head, as for the GPT.

Parameter tree::

    {"wte": {"embedding": (V, C)},                # target tokens; the source's too with share_embeddings
     "src_wte": {"embedding": (V_src, C)},        # separate source embedding only
     "wpe", "src_wpe": {"embedding": (T or S rows, C)},   # learned positions only
     "enc_i": {"ln_1", "attn": {"qkv", "out"}, "ln_2", "mlp"},                    # as the GPT's h_i
     "dec_i": {"ln_1", "attn": {"qkv", "out"}, "ln_2",
               "cross": {"q": {"kernel": (C, H, D), "bias": (H, D)},
                         "kv": {"kernel": (C, 2, H, D), "bias": (2, H, D)},
                         "out": {"kernel": (H, D, C), "bias": (C,)}},
               "ln_3", "mlp"},
     "enc_ln_f", "ln_f": {...},                   # final_norm only
     "lm_head": {"kernel": (C, V), "bias": (V,)}} # untied only

Config: the flat dict of `Seq2SeqConfig.to_dict()` (the ModelConfig fields plus n_encoder_layer,
src_vocab_size, src_block_size, share_embeddings).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from reference import numpy_reference as ref

Params = ref.Params
Config = ref.Config


def embed_tokens(table_VC: np.ndarray, positions_PC: np.ndarray | None, tokens_BT: np.ndarray,
                 cfg: Config) -> np.ndarray:
    """Look up each token, scale by sqrt(C) if configured, add the row of its position 0..T-1."""
    n_embd = int(cfg["n_embd"])
    x_BTC = table_VC[tokens_BT]
    if cfg["scale_embeddings"]:
        x_BTC = x_BTC * math.sqrt(n_embd)
    seq_len = tokens_BT.shape[1]
    if cfg["position"] == "learned":
        return x_BTC + positions_PC[:seq_len][None]
    if cfg["position"] == "none":
        return x_BTC
    return x_BTC + ref.sinusoidal_table(seq_len, n_embd, cfg["position"])[None]


def cross_attention(x_BTC: np.ndarray, memory_BSC: np.ndarray, p: Params, visible_BTS: np.ndarray,
                    cfg: Config) -> tuple[np.ndarray, np.ndarray]:
    """Multi-head attention: queries from the decoder stream, keys and values from the encoder output.

    Returns (output_BTC, probabilities_BHTS).
    """
    use_bias = bool(cfg["use_bias"])
    q_BTHD = np.einsum("btc,chd->bthd", x_BTC, p["q"]["kernel"])
    kv_2BSHD = np.einsum("bsc,cihd->ibshd", memory_BSC, p["kv"]["kernel"])
    if use_bias:
        q_BTHD = q_BTHD + p["q"]["bias"]
        kv_2BSHD = kv_2BSHD + p["kv"]["bias"][:, None, None]
    k_BSHD, v_BSHD = kv_2BSHD[0], kv_2BSHD[1]
    scores_BHTS = np.einsum("bthd,bshd->bhts", q_BTHD, k_BSHD) / math.sqrt(int(cfg["head_dim"]))
    probs_BHTS = ref.softmax(np.where(visible_BTS[:, None], scores_BHTS, -np.inf), axis=-1)
    y_BTHD = np.einsum("bhts,bshd->bthd", probs_BHTS, v_BSHD)
    out_BTC = np.einsum("bthd,hdc->btc", y_BTHD, p["out"]["kernel"])
    return (out_BTC + p["out"]["bias"] if use_bias else out_BTC), probs_BHTS


def residual(x_BTC: np.ndarray, f: Any, norm_p: Params, cfg: Config) -> np.ndarray:
    """x + f(norm(x)) pre-norm, norm(x + f(x)) post-norm."""
    if cfg["norm_placement"] == "pre":
        return x_BTC + f(ref.norm(x_BTC, norm_p, cfg))
    return ref.norm(x_BTC + f(x_BTC), norm_p, cfg)


def attention_residual(x_BTC: np.ndarray, attn: Any, norm_p: Params, cfg: Config) -> tuple[np.ndarray, np.ndarray]:
    """`residual` around an attention that returns (output, probabilities); returns (x, probabilities)."""
    kept = []

    def output_only(h_BTC: np.ndarray) -> np.ndarray:
        out_BTC, probs = attn(h_BTC)
        kept.append(probs)
        return out_BTC

    return residual(x_BTC, output_only, norm_p, cfg), kept[0]


def encode(params: Params, src: np.ndarray, cfg: Config, src_mask: np.ndarray | None = None
           ) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """The encoder output (B, S, C), which source positions are real (B, S), and each layer's probabilities."""
    params = ref.to_float64(params)
    src_BS = np.asarray(src)
    real_BS = ~ref.padding_mask(src_BS, cfg, src_mask)
    visible_BSS = np.broadcast_to(real_BS[:, None, :], (*src_BS.shape, src_BS.shape[1]))
    table_VC = params["wte" if cfg["share_embeddings"] else "src_wte"]["embedding"]
    x_BSC = embed_tokens(table_VC, params.get("src_wpe", {}).get("embedding"), src_BS, cfg)
    probs = []
    for layer in range(int(cfg["n_encoder_layer"])):
        p = params[f"enc_{layer}"]
        x_BSC, probs_BHSS = attention_residual(x_BSC, lambda h, p=p: ref.attention(h, p["attn"], visible_BSS, cfg),
                                               p["ln_1"], cfg)
        x_BSC = residual(x_BSC, lambda h, p=p: ref.mlp(h, p["mlp"], cfg), p["ln_2"], cfg)
        probs.append(probs_BHSS)
    if cfg["final_norm"]:
        x_BSC = ref.norm(x_BSC, params["enc_ln_f"], cfg)
    return x_BSC, real_BS, probs


def decode(params: Params, tgt: np.ndarray, memory_BSC: np.ndarray, src_real_BS: np.ndarray, cfg: Config,
           tgt_mask: np.ndarray | None = None) -> tuple[np.ndarray, dict[str, list[np.ndarray]]]:
    """Logits (B, T, V) after each target prefix, and the self- and cross-attention probabilities per layer."""
    params = ref.to_float64(params)
    tgt_BT = np.asarray(tgt)
    visible_BTT = ref.attention_visibility(ref.padding_mask(tgt_BT, cfg, tgt_mask))
    visible_BTS = np.broadcast_to(src_real_BS[:, None, :], (tgt_BT.shape[0], tgt_BT.shape[1], src_real_BS.shape[1]))
    x_BTC = embed_tokens(params["wte"]["embedding"], params.get("wpe", {}).get("embedding"), tgt_BT, cfg)
    probs: dict[str, list[np.ndarray]] = {"self": [], "cross": []}
    for layer in range(int(cfg["n_layer"])):
        p = params[f"dec_{layer}"]
        x_BTC, self_BHTT = attention_residual(x_BTC, lambda h, p=p: ref.attention(h, p["attn"], visible_BTT, cfg),
                                              p["ln_1"], cfg)
        x_BTC, cross_BHTS = attention_residual(
            x_BTC, lambda h, p=p: cross_attention(h, memory_BSC, p["cross"], visible_BTS, cfg), p["ln_2"], cfg)
        x_BTC = residual(x_BTC, lambda h, p=p: ref.mlp(h, p["mlp"], cfg), p["ln_3"], cfg)
        probs["self"].append(self_BHTT)
        probs["cross"].append(cross_BHTS)
    if cfg["final_norm"]:
        x_BTC = ref.norm(x_BTC, params["ln_f"], cfg)
    return ref.lm_logits(params, x_BTC, cfg), probs


def forward(params: Params, src: np.ndarray, tgt: np.ndarray, cfg: Config, src_mask: np.ndarray | None = None,
            tgt_mask: np.ndarray | None = None) -> tuple[np.ndarray, dict[str, list[np.ndarray]]]:
    """Teacher-forced pass: logits (B, T, V) and attention probabilities ("encoder", "self", "cross")."""
    memory_BSC, real_BS, encoder_probs = encode(params, src, cfg, src_mask)
    logits_BTV, probs = decode(params, tgt, memory_BSC, real_BS, cfg, tgt_mask)
    return logits_BTV, {"encoder": encoder_probs, **probs}


def loss(params: Params, src: np.ndarray, tgt_in: np.ndarray, tgt_out: np.ndarray, cfg: Config) -> float:
    """Mean cross-entropy of tgt_out[b, t] given the source and tgt_in[b, :t+1], over all B*T positions."""
    logp_BTV = ref.log_softmax(forward(params, src, tgt_in, cfg)[0], axis=-1)
    return float(-np.mean(np.take_along_axis(logp_BTV, np.asarray(tgt_out)[..., None], axis=-1)))


def random_params(cfg: Config, seed: int = 0, std: float = 0.5) -> dict:
    """Random float64 parameters in the documented layout (norm scales around 1); large std so every term shows."""
    rng = np.random.default_rng(seed)
    n_embd, n_head, head_dim = int(cfg["n_embd"]), int(cfg["n_head"]), int(cfg["head_dim"])
    use_bias = bool(cfg["use_bias"])

    def dense(*shape: int, bias_shape: tuple[int, ...]) -> dict:
        layer = {"kernel": rng.normal(0.0, std, size=shape)}
        if use_bias:
            layer["bias"] = rng.normal(0.0, std, size=bias_shape)
        return layer

    def norm_params() -> dict:
        layer = {"scale": 1.0 + rng.normal(0.0, std, size=n_embd)}
        if use_bias:
            layer["bias"] = rng.normal(0.0, std, size=n_embd)
        return layer

    def attention() -> dict:
        return {"qkv": dense(n_embd, 3, n_head, head_dim, bias_shape=(3, n_head, head_dim)),
                "out": dense(n_head, head_dim, n_embd, bias_shape=(n_embd,))}

    def mlp() -> dict:
        return {"fc": dense(n_embd, int(cfg["d_ff"]), bias_shape=(int(cfg["d_ff"]),)),
                "proj": dense(int(cfg["d_ff"]), n_embd, bias_shape=(n_embd,))}

    table = lambda rows: {"embedding": rng.normal(0.0, std, size=(rows, n_embd))}
    params: dict[str, Any] = {"wte": table(int(cfg["vocab_size"]))}
    if not cfg["share_embeddings"]:
        params["src_wte"] = table(int(cfg["src_vocab_size"]))
    if cfg["position"] == "learned":
        params["wpe"], params["src_wpe"] = table(int(cfg["block_size"])), table(int(cfg["src_block_size"]))
    for layer in range(int(cfg["n_encoder_layer"])):
        params[f"enc_{layer}"] = {"ln_1": norm_params(), "attn": attention(), "ln_2": norm_params(), "mlp": mlp()}
    for layer in range(int(cfg["n_layer"])):
        cross = {"q": dense(n_embd, n_head, head_dim, bias_shape=(n_head, head_dim)),
                 "kv": dense(n_embd, 2, n_head, head_dim, bias_shape=(2, n_head, head_dim)),
                 "out": dense(n_head, head_dim, n_embd, bias_shape=(n_embd,))}
        params[f"dec_{layer}"] = {"ln_1": norm_params(), "attn": attention(), "ln_2": norm_params(), "cross": cross,
                                  "ln_3": norm_params(), "mlp": mlp()}
    if cfg["final_norm"]:
        params["enc_ln_f"], params["ln_f"] = norm_params(), norm_params()
    if not cfg["tie_embeddings"]:
        params["lm_head"] = dense(n_embd, int(cfg["vocab_size"]), bias_shape=(int(cfg["vocab_size"]),))
    return params
