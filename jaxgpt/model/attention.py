"""The self-attention module and its key/value cache; the attention itself is `jaxgpt.ops.attention.attend`.

Shapes: B batch, T query length, S key length (the cache length when decoding), H heads, K key/value heads
(n_kv_head: H with plain multi-head attention, fewer with grouped-query attention), D head_dim, C n_embd,
L layers. Keys and values are head-major, (B, K, S, D): the layout both attention products want, and the
cache's.

The cache holds (B, K, S, D) keys and values per layer (K heads, never repeated to H): a list of {"k", "v"}
for listed layers, one {"k", "v"} stacked to (L, B, K, S, D) for scanned ones (`nn.scan` hands each layer its
slice). A stacked buffer for listed layers too was measured slower: XLA:CPU then copies each layer's slice
out of it for the attention products on every token (a `slice_bitcast_fusion` per layer), while a buffer per
layer is read in place.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxgpt.model.config import ModelConfig
from jaxgpt.model.layers import EinsumDense, Norm, rotary
from jaxgpt.ops.attention import Cache, attend, attend_qkv, work_dtype
from jaxgpt.ops.projection import DECLARED

Array = jax.Array


def init_cache(cfg: ModelConfig, batch_size: int, length: int | None = None,
               dtype: str | None = None) -> Cache | list[Cache]:
    """Zeroed KV cache for `GPT.decode`: a (B, K, S, D) pair per layer, stacked when layers are scanned."""
    shape = (batch_size, cfg.n_kv_head, length or cfg.block_size, cfg.head_dim)
    dtype = dtype or work_dtype(cfg.dtype)
    zeros = lambda *lead: {"k": jnp.zeros((*lead, *shape), dtype), "v": jnp.zeros((*lead, *shape), dtype)}
    return zeros(cfg.n_layer) if cfg.scan_layers else [zeros() for _ in range(cfg.n_layer)]


class Attention(nn.Module):
    """Multi-head attention: the GPT's, and every attention of the encoder-decoder.

    Self-attention (`cross` False) projects queries, keys and values with one fused (C, 3, H, D) kernel `qkv`;
    cross-attention projects queries `q` (C, H, D) from x and keys and values with one (C, 2, H, D) kernel `kv`
    from a memory, given as the memory (B, S, C) or as its keys and values (`memory_kv`: decoding computes them
    once per source). Grouped-query self-attention (n_kv_head K < H) has cross-attention's two kernels, `kv`
    (C, 2, K, D) with K heads, from x: query heads k G .. (k + 1) G - 1 share key/value head k (G = H / K).
    Rotary positions (rope_theta) rotate the queries and keys at their positions (cache_index on when decoding;
    `positions_BT` when given, which packed rows restart at each document, `GPT.hidden`: a learned QK-norm scale
    makes even rotary attention depend on more than distances), then QK-norm (qk_norm) normalizes them,
    nanochat's order; the cache holds them rotated and normalized.
    `causal` says the visible keys are a causal subset (the GPT, the decoder's self-attention),
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
        H, K, D, C = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.n_embd
        dense = functools.partial(EinsumDense, cfg, fans=(C, H * D), out_dtype=work_dtype(cfg.dtype),
                                  kernel_storage=self.kernel_storage)
        fused = ("embed", None, "heads", "head_dim"), (None, "heads", "head_dim")
        if self.cross or K != H:
            kv_heads = "heads" if K == H else "kv_heads"  # K < H heads shard by a rule of their own
            self.q = dense("btc,chd->bthd", (C, H, D), ("embed", "heads", "head_dim"), ("heads", "head_dim"))
            self.kv = dense("bsc,ckhd->bskhd", (C, 2, K, D), ("embed", None, kv_heads, "head_dim"),
                            (None, kv_heads, "head_dim"), fans=(C, K * D))
        else:
            self.qkv = dense("btc,ckhd->btkhd", (C, 3, H, D), *fused)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = (Norm(cfg, kind="rmsnorm", bias=False, out_dtype=work_dtype(cfg.dtype),
                                             name=name) for name in ("q_norm", "k_norm"))
        self.out = EinsumDense(cfg, "bthd,hdc->btc", (H, D, C), ("heads", "head_dim", "embed"), ("embed",),
                               residual=True, fans=(H * D, C), kernel_storage=self.kernel_storage)
        self.drop = nn.Dropout(cfg.attn_dropout, name="Dropout_0")  # the name its dropout stream always had

    def memory_kv(self, memory_BSC: Array) -> tuple[Array, Array]:
        """Head-major keys and values (B, K, S, D) of the `kv` kernel: cross-attention's of the memory."""
        kv = self.kv(memory_BSC)
        return kv[:, :, 0].transpose(0, 2, 1, 3), kv[:, :, 1].transpose(0, 2, 1, 3)

    def __call__(self, x_BTC: Array, visible_BTS: Array, deterministic: bool, cache: Cache | None = None,
                 cache_index: Array | None = None, memory: Array | tuple[Array, Array] | None = None,
                 positions_BT: Array | None = None) -> tuple[Array, Cache | None]:
        cfg = self.cfg
        if self.cross:
            q_BTHD = self.q(x_BTC)
            k_BKSD, v_BKSD = memory if isinstance(memory, tuple) else self.memory_kv(memory)
        elif cfg.n_kv_head != cfg.n_head:
            q_BTHD = self.q(x_BTC)
            k_BKSD, v_BKSD = self.memory_kv(x_BTC)
        else:
            qkv = self.qkv(x_BTC)
            decoded = None if cache is None or cfg.rotary or cfg.qk_norm else attend_qkv(
                qkv, cache, cache_index, impl=cfg.attention_impl, dtype=cfg.dtype)
            if decoded is not None:  # one new token, one kernel reading q, k and v from the projection as it is
                return self.out(decoded[0]), decoded[1]
            q_BTHD = qkv[:, :, 0]
            k_BKSD, v_BKSD = qkv[:, :, 1].transpose(0, 2, 1, 3), qkv[:, :, 2].transpose(0, 2, 1, 3)
        if cfg.rotary:  # this call's tokens sit at positions_BT, else at cache_index.. (0.. without a cache)
            rotate, pos = rotary, jnp.arange(x_BTC.shape[1]) + (0 if cache_index is None else cache_index)
            if positions_BT is not None:  # a position per token (packed rows restart them): `rotary` per row
                rotate, pos = jax.vmap(rotary, in_axes=(0, 0, None)), positions_BT
            q_BTHD = rotate(q_BTHD, pos, cfg.rope_theta)
            k_BKSD = rotate(k_BKSD.transpose(0, 2, 1, 3), pos, cfg.rope_theta).transpose(0, 2, 1, 3)
        if cfg.qk_norm:
            q_BTHD, k_BKSD = self.q_norm(q_BTHD), self.k_norm(k_BKSD)
        y_BTHD, probs, cache = attend(q_BTHD, k_BKSD, v_BKSD, visible_BTS, impl=cfg.attention_impl, dtype=cfg.dtype,
                                      causal=self.causal, cache=cache, cache_index=cache_index,
                                      dropout=None if deterministic or not cfg.attn_dropout
                                      else lambda p: self.drop(p, deterministic=False))
        if probs is not None:
            self.sow("intermediates", "attn_weights", probs)  # dropped unless asked for
        return self.out(y_BTHD), cache
