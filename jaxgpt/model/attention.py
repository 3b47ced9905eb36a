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
from jaxgpt.model.layers import EinsumDense, Norm, rope_frequencies, rotary
from jaxgpt.ops.attention import Cache, Scores, attend, attend_qkv, work_dtype
from jaxgpt.ops.projection import DECLARED

Array = jax.Array
Windowed = bool | Array  # whether a layer is windowed: a Python bool, or a traced one per layer under `nn.scan`


def per_layer(windowed: Windowed, local: object, other: object) -> object:
    """`local` for a windowed layer, else `other` (pytrees alike): chosen when tracing for a Python bool, else
    elementwise by the traced flag (scanned layers of both kinds, Gemma 3's pattern)."""
    if isinstance(windowed, bool):
        return local if windowed else other
    return jax.tree.map(lambda a, b: jnp.where(windowed, a, b), local, other)


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
    From output-major kernels (the sampler's batch-1 weights: `jaxgpt.ops.projection`) it has one `qkv` kernel
    (C, H + 2K, D), the two stacked along their outputs (`decode_weights.output_major_kernels` stacks them):
    XLA:CPU streams one product's weights faster than two in a row (docs/benchmarks.md).
    Rotary positions (rope_theta) rotate the queries and keys at their positions (cache_index on when decoding;
    `positions_BT` when given, which packed rows restart at each document, `GPT.hidden`: a learned QK-norm scale
    makes even rotary attention depend on more than distances), then QK-norm (qk_norm) normalizes them,
    nanochat's order, or before the rotary (qk_norm_site); the cache holds them rotated and normalized.
    A windowed layer (`windowed`, sliding_window) attends over `window_BTS` instead of `visible_BTS` and rotates
    at its own frequencies (`layers.rope_frequencies`).
    `causal` says the visible keys are a causal subset (the GPT, the decoder's self-attention),
    so the attention may skip the masked triangle; the encoder and cross-attention see keys after the query.
    A KV cache (`init_cache`) makes self-attention write this call's keys and values at `cache_index` and attend
    over the whole cache.
    """

    cfg: ModelConfig
    causal: bool = True
    cross: bool = False
    kernel_storage: str = DECLARED  # `EinsumDense.kernel_storage`

    @property
    def stacks_grouped_qkv(self) -> bool:
        """Whether grouped-query self-attention projects with one `qkv` kernel (H + 2K output heads: output-major
        storage) rather than `q` and `kv`."""
        return self.cfg.n_kv_head != self.cfg.n_head and not self.cross and self.kernel_storage != DECLARED

    def setup(self) -> None:
        cfg = self.cfg
        H, K, D, C = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.n_embd
        dense = functools.partial(EinsumDense, cfg, fans=(C, H * D), out_dtype=work_dtype(cfg.dtype),
                                  kernel_storage=self.kernel_storage, bias=cfg.has_qkv_bias)
        fused = ("embed", None, "heads", "head_dim"), (None, "heads", "head_dim")
        kv_heads = "heads" if K == H else "kv_heads"  # K < H heads shard by a rule of their own
        if self.stacks_grouped_qkv:  # q, then k, then v heads
            self.qkv = dense("btc,cnd->btnd", (C, H + 2 * K, D), ("embed", None, "head_dim"), (None, "head_dim"))
        elif self.cross or K != H:
            self.q = dense("btc,chd->bthd", (C, H, D), ("embed", "heads", "head_dim"), ("heads", "head_dim"))
            self.kv = dense("bsc,ckhd->bskhd", (C, 2, K, D), ("embed", None, kv_heads, "head_dim"),
                            (None, kv_heads, "head_dim"), fans=(C, K * D))
        else:
            self.qkv = dense("btc,ckhd->btkhd", (C, 3, H, D), *fused)
        if cfg.qk_norm:  # per head over D, or (qk_norm_site "projection") over each whole projection
            whole = cfg.qk_norm_site == "projection"
            self.q_norm, self.k_norm = (Norm(cfg, kind="rmsnorm", bias=False, out_dtype=work_dtype(cfg.dtype),
                                             names=(heads, "head_dim") if whole else ("norm",), name=name)
                                        for name, heads in (("q_norm", "heads"), ("k_norm", kv_heads)))
        self.out = EinsumDense(cfg, "bthd,hdc->btc", (H, D, C), ("heads", "head_dim", "embed"), ("embed",),
                               residual=True, fans=(H * D, C), kernel_storage=self.kernel_storage)
        self.drop = nn.Dropout(cfg.attn_dropout, name="Dropout_0")  # the name its dropout stream always had

    def memory_kv(self, memory_BSC: Array) -> tuple[Array, Array]:
        """Head-major keys and values (B, K, S, D) of the `kv` kernel: cross-attention's of the memory."""
        kv = self.kv(memory_BSC)
        return kv[:, :, 0].transpose(0, 2, 1, 3), kv[:, :, 1].transpose(0, 2, 1, 3)

    def __call__(self, x_BTC: Array, visible_BTS: Array, deterministic: bool, cache: Cache | None = None,
                 cache_index: Array | None = None, memory: Array | tuple[Array, Array] | None = None,
                 positions_BT: Array | None = None, window_BTS: Array | None = None,
                 windowed: Windowed = False) -> tuple[Array, Cache | None]:
        cfg = self.cfg
        scores = Scores(cfg.query_scale, cfg.attn_softcap, cfg.sliding_window is not None)
        if self.cross:
            q_BTHD = self.q(x_BTC)
            k_BKSD, v_BKSD = memory if isinstance(memory, tuple) else self.memory_kv(memory)
        else:
            if self.stacks_grouped_qkv:
                q_BTHD, k_BSKD, v_BSKD = jnp.split(self.qkv(x_BTC), (cfg.n_head, cfg.n_head + cfg.n_kv_head), axis=2)
            elif cfg.n_kv_head != cfg.n_head:
                q_BTHD, kv = self.q(x_BTC), self.kv(x_BTC)
                k_BSKD, v_BSKD = kv[:, :, 0], kv[:, :, 1]
            else:
                qkv = self.qkv(x_BTC)
                decoded = None if cache is None or cfg.rotary or cfg.qk_norm else attend_qkv(
                    qkv, cache, cache_index, impl=cfg.attention_impl, dtype=cfg.dtype, scores=scores)
                if decoded is not None:  # one new token, one kernel reading q, k and v from the projection as it is
                    return self.out(decoded[0]), decoded[1]
                q_BTHD, k_BSKD, v_BSKD = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
            q_BTHD, k_BSKD = self._positions(q_BTHD, k_BSKD, cache_index, positions_BT, windowed)
            k_BKSD, v_BKSD = k_BSKD.transpose(0, 2, 1, 3), v_BSKD.transpose(0, 2, 1, 3)
            if cfg.qk_norm and cfg.qk_norm_site == "after_rope":  # (head-major keys: scanned layers' fusions and
                q_BTHD, k_BKSD = self.q_norm(q_BTHD), self.k_norm(k_BKSD)  # so their float sums as they were)
        if scores.windowed:
            visible_BTS = per_layer(windowed, window_BTS, visible_BTS)
        y_BTHD, probs, cache = attend(q_BTHD, k_BKSD, v_BKSD, visible_BTS, impl=cfg.attention_impl, dtype=cfg.dtype,
                                      causal=self.causal, cache=cache, cache_index=cache_index, scores=scores,
                                      dropout=None if deterministic or not cfg.attn_dropout
                                      else lambda p: self.drop(p, deterministic=False))
        if probs is not None:
            self.sow("intermediates", "attn_weights", probs)  # dropped unless asked for
        return self.out(y_BTHD), cache

    def _positions(self, q_BTHD: Array, k_BSKD: Array, cache_index: Array | None, positions_BT: Array | None,
                   windowed: Windowed) -> tuple[Array, Array]:
        """Queries and keys QK-normalized before the rotary (qk_norm_site), then rotated (rope_theta)."""
        cfg = self.cfg
        if cfg.qk_norm and cfg.qk_norm_site != "after_rope":
            q_BTHD, k_BSKD = self.q_norm(q_BTHD), self.k_norm(k_BSKD)
        if cfg.rotary:  # this call's tokens sit at positions_BT, else at cache_index.. (0.. without a cache)
            rotate, pos = rotary, jnp.arange(q_BTHD.shape[1]) + (0 if cache_index is None else cache_index)
            if positions_BT is not None:  # a position per token (packed rows restart them): `rotary` per row
                rotate, pos = jax.vmap(rotary, in_axes=(0, 0, None, None)), positions_BT
            freq_h, factor = per_layer(windowed, rope_frequencies(cfg, True), rope_frequencies(cfg, False)) \
                if cfg.sliding_window is not None else rope_frequencies(cfg, False)
            q_BTHD, k_BSKD = rotate(q_BTHD, pos, freq_h, factor), rotate(k_BSKD, pos, freq_h, factor)
        return q_BTHD, k_BSKD
