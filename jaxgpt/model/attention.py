"""The self-attention module and its key/value cache; the attention itself is `jaxgpt.ops.attention.attend`.

Shapes: B batch, T query length, S key length (the cache length when decoding), H heads, D head_dim,
C n_embd, L layers. Keys and values are head-major, (B, H, S, D): the layout both attention products
want, and the cache's.

The cache holds (B, H, S, D) keys and values per layer: a list of {"k", "v"} for listed layers, one
{"k", "v"} stacked to (L, B, H, S, D) for scanned ones (`nn.scan` hands each layer its slice). A stacked
buffer for listed layers too was measured slower: XLA:CPU then copies each layer's slice out of it for
the attention products on every token (a `slice_bitcast_fusion` per layer), while a buffer per layer is
read in place.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxgpt.model.config import ModelConfig
from jaxgpt.model.layers import EinsumDense
from jaxgpt.ops.attention import Cache, attend, work_dtype
from jaxgpt.ops.projection import DECLARED

Array = jax.Array


def init_cache(cfg: ModelConfig, batch_size: int, length: int | None = None,
               dtype: str | None = None) -> Cache | list[Cache]:
    """Zeroed KV cache for `GPT.decode`: a (B, H, S, D) pair per layer, stacked when layers are scanned."""
    shape = (batch_size, cfg.n_head, length or cfg.block_size, cfg.head_dim)
    dtype = dtype or work_dtype(cfg.dtype)
    zeros = lambda *lead: {"k": jnp.zeros((*lead, *shape), dtype), "v": jnp.zeros((*lead, *shape), dtype)}
    return zeros(cfg.n_layer) if cfg.scan_layers else [zeros() for _ in range(cfg.n_layer)]


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention over visible keys, optionally reading/writing a KV cache."""

    cfg: ModelConfig
    kernel_storage: str = DECLARED  # `EinsumDense.kernel_storage`

    @nn.compact
    def __call__(self, x_BTC: Array, visible_BTS: Array, deterministic: bool, cache: Cache | None = None,
                 cache_index: Array | None = None) -> tuple[Array, Cache | None]:
        cfg = self.cfg
        H, D, C = cfg.n_head, cfg.head_dim, cfg.n_embd
        qkv = EinsumDense(cfg, "btc,ckhd->btkhd", (C, 3, H, D), ("embed", None, "heads", "head_dim"),
                          (None, "heads", "head_dim"), fans=(C, H * D), out_dtype=work_dtype(cfg.dtype),
                          kernel_storage=self.kernel_storage, name="qkv")(x_BTC)
        q_BTHD = qkv[:, :, 0]
        k_BHSD, v_BHSD = qkv[:, :, 1].transpose(0, 2, 1, 3), qkv[:, :, 2].transpose(0, 2, 1, 3)
        drop = nn.Dropout(cfg.attn_dropout)
        y_BTHD, probs, cache = attend(q_BTHD, k_BHSD, v_BHSD, visible_BTS, impl=cfg.attention_impl, dtype=cfg.dtype,
                                      causal=True, cache=cache, cache_index=cache_index,
                                      dropout=None if deterministic or not cfg.attn_dropout
                                      else lambda p: drop(p, deterministic=False))
        if probs is not None:
            self.sow("intermediates", "attn_weights", probs)  # dropped unless asked for
        return EinsumDense(cfg, "bthd,hdc->btc", (H, D, C), ("heads", "head_dim", "embed"), ("embed",), residual=True,
                           fans=(H * D, C), kernel_storage=self.kernel_storage, name="out")(y_BTHD), cache
