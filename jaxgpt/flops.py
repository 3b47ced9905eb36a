"""Model FLOPs per token and this machine's measured matmul peak, for honest utilization numbers."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from jaxgpt.config import ModelConfig


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that take part in a matmul per token: everything except embedding lookups.

    A tied token embedding is counted once, as the output head; position tables never are.
    """
    C, F, H, D, L, V = cfg.n_embd, cfg.d_ff, cfg.n_head, cfg.head_dim, cfg.n_layer, cfg.vocab_size
    per_layer = C * 3 * H * D + H * D * C + 2 * C * F
    return L * per_layer + C * V


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token: 6 N for the weights (forward 2N, backward 4N) plus causal attention.

    Causal attention scores and the weighted sum each cost 2 * (T/2) * H * D per token and layer on
    average in the forward pass, times 3 for forward plus backward.
    """
    T = seq_len or cfg.block_size
    attention = 3 * 2 * 2 * (T / 2) * cfg.n_head * cfg.head_dim * cfg.n_layer
    return 6 * matmul_params(cfg) + attention


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
