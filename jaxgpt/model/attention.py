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

import functools

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


class Attention(nn.Module):
    """Multi-head attention: the GPT's, and every attention of the encoder-decoder.

    Self-attention (`cross` False) projects queries, keys and values with one fused (C, 3, H, D) kernel `qkv`;
    cross-attention projects queries `q` (C, H, D) from x and keys and values with one (C, 2, H, D) kernel `kv`
    from a memory, given as the memory (B, S, C) or as its keys and values (`memory_kv`: decoding computes them
    once per source). `causal` says the visible keys are a causal subset (the GPT, the decoder's self-attention),
    so the attention may skip the masked triangle; the encoder and cross-attention see keys after the query.
    A KV cache (`init_cache`) makes self-attention write this call's keys and values at `cache_index` and attend
    over the whole cache.
    """

    cfg: ModelConfig
    causal: bool = True
    cross: bool = False
    kernel_storage: str = DECLARED  # `EinsumDense.kernel_storage`

    def setup(self) -> None:
        cfg = self.cfg
        H, D, C = cfg.n_head, cfg.head_dim, cfg.n_embd
        dense = functools.partial(EinsumDense, cfg, fans=(C, H * D), out_dtype=work_dtype(cfg.dtype),
                                  kernel_storage=self.kernel_storage)
        fused = ("embed", None, "heads", "head_dim"), (None, "heads", "head_dim")
        if self.cross:
            self.q = dense("btc,chd->bthd", (C, H, D), ("embed", "heads", "head_dim"), ("heads", "head_dim"))
            self.kv = dense("bsc,ckhd->bskhd", (C, 2, H, D), *fused)
        else:
            self.qkv = dense("btc,ckhd->btkhd", (C, 3, H, D), *fused)
        self.out = EinsumDense(cfg, "bthd,hdc->btc", (H, D, C), ("heads", "head_dim", "embed"), ("embed",),
                               residual=True, fans=(H * D, C), kernel_storage=self.kernel_storage)
        self.drop = nn.Dropout(cfg.attn_dropout, name="Dropout_0")  # the name its dropout stream always had

    def memory_kv(self, memory_BSC: Array) -> tuple[Array, Array]:
        """Cross-attention's head-major keys and values (B, H, S, D) of the memory."""
        kv = self.kv(memory_BSC)
        return kv[:, :, 0].transpose(0, 2, 1, 3), kv[:, :, 1].transpose(0, 2, 1, 3)

    def __call__(self, x_BTC: Array, visible_BTS: Array, deterministic: bool, cache: Cache | None = None,
                 cache_index: Array | None = None, memory: Array | tuple[Array, Array] | None = None
                 ) -> tuple[Array, Cache | None]:
        cfg = self.cfg
        if self.cross:
            q_BTHD = self.q(x_BTC)
            k_BHSD, v_BHSD = memory if isinstance(memory, tuple) else self.memory_kv(memory)
        else:
            qkv = self.qkv(x_BTC)
            q_BTHD = qkv[:, :, 0]
            k_BHSD, v_BHSD = qkv[:, :, 1].transpose(0, 2, 1, 3), qkv[:, :, 2].transpose(0, 2, 1, 3)
        y_BTHD, probs, cache = attend(q_BTHD, k_BHSD, v_BHSD, visible_BTS, impl=cfg.attention_impl, dtype=cfg.dtype,
                                      causal=self.causal, cache=cache, cache_index=cache_index,
                                      dropout=None if deterministic or not cfg.attn_dropout
                                      else lambda p: self.drop(p, deterministic=False))
        if probs is not None:
            self.sow("intermediates", "attn_weights", probs)  # dropped unless asked for
        return self.out(y_BTHD), cache
