"""Model FLOPs per token and this machine's measured matmul peak, for honest utilization numbers."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from jaxgpt.model.config import ModelConfig, Seq2SeqConfig


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that take part in a matmul per token: everything except embedding lookups.

    A tied token embedding is counted once, as the output head; position tables never are.
    """
    C, F, H, D, L, V = cfg.n_embd, cfg.d_ff, cfg.n_head, cfg.head_dim, cfg.n_layer, cfg.vocab_size
    mlp = (3 if cfg.gated_mlp else 2) * C * F  # fc and proj, and gate
    per_layer = C * (H + 2 * cfg.n_kv_head) * D + H * D * C + mlp  # q, k and v (K heads), out, MLP
    return L * per_layer + C * V


def flops_per_token(cfg: ModelConfig | Seq2SeqConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token: 6 N for the weights (forward 2N, backward 4N) plus causal attention.

    Causal attention scores and the weighted sum each cost 2 * (T/2) * H * D per token and layer on
    average in the forward pass (fewer in a sliding window's layers: `_mean_keys`), times 3 for forward plus
    backward. An encoder-decoder's rows are its
    block sizes (`seq2seq_flops_per_token`).
    """
    if isinstance(cfg, Seq2SeqConfig):
        return seq2seq_flops_per_token(cfg)
    T = seq_len or cfg.block_size
    keys = sum(_mean_keys(T, cfg.sliding_window if windowed else None) for windowed in cfg.windowed_layers())
    attention = 3 * 2 * 2 * keys * cfg.n_head * cfg.head_dim
    return 6 * matmul_params(cfg) + attention


def _mean_keys(T: int, window: int | None) -> float:
    """Keys a query attends to, on average over a row of T: T / 2 causally (the usual rounding of (T + 1) / 2); a
    window W < T caps query i at min(i + 1, W), W - W (W - 1) / 2T on average."""
    return T / 2 if window is None or window >= T else window - window * (window - 1) / (2 * T)


def seq2seq_flops_per_token(cfg: Seq2SeqConfig) -> float:
    """Training FLOPs per token of an encoder-decoder row of S = src_block_size source and T = block_size
    target tokens, counted like the GPT's (6 per weight use, 3 x 4 H D per attended key) and divided by S + T.

    Per row: each encoder layer uses its attention (4 C HD) and MLP (2 C F) weights once per source token;
    each decoder layer its self-attention, cross-attention query and output (6 C HD) and MLP weights per
    target token, and the cross-attention keys and values (2 C HD) per source token; the head C V per target
    token. Attention: the encoder's S x S, the decoder's causal T x T / 2 and its cross T x S keys.
    """
    mc = cfg.model
    S, T, C, F, HD = cfg.src_block_size, mc.block_size, mc.n_embd, mc.d_ff, mc.n_head * mc.head_dim
    weights = (cfg.n_encoder_layer * (4 * C * HD + 2 * C * F) * S
               + mc.n_layer * ((6 * C * HD + 2 * C * F) * T + 2 * C * HD * S) + C * mc.vocab_size * T)
    attention = 4 * HD * (cfg.n_encoder_layer * S * S + mc.n_layer * (T * T / 2 + T * S))
    return (6 * weights + 3 * attention) / (S + T)


def measure_matmul_peak(n: int = 1024, repeats: int = 20, dtype: str = "float32") -> float:
    """FLOP/s of a large square matmul on the default device: the practical peak to compare against."""
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    start = time.perf_counter()
    for _ in range(repeats):
        out = f(a)
    out.block_until_ready()
    return 2 * n**3 * repeats / (time.perf_counter() - start)
