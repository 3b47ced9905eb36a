"""Attention behind one function, `attend`, and the self-attention module with its key/value cache.

Shapes: B batch, T query length, S key length (the cache length when decoding), H heads, D head_dim,
C n_embd, L layers. Keys and values are head-major, (B, H, S, D): the layout both attention products
want, and the cache's.

`attend` has four paths (`ModelConfig.attention_impl`): "einsum" (explicit products and softmax, the
only one with attention-probability dropout and sown weights; causal query blocks skip the masked
triangle), "xla" (`jax.nn.dot_product_attention`, XLA's fused attention), "cudnn" (its cuDNN flash
attention on NVIDIA GPUs) and "splash" (TPU flash attention, `jaxgpt.ops.kernels`). "auto" picks per platform
(`resolve_impl`). Decoding one token against a cache has a path of its own (`attend_one`).

The cache holds (B, H, S, D) keys and values per layer: a list of {"k", "v"} for listed layers, one
{"k", "v"} stacked to (L, B, H, S, D) for scanned ones (`nn.scan` hands each layer its slice). A stacked
buffer for listed layers too was measured: XLA:CPU then copies each layer's slice out of it for the
attention products on every token (a `slice_bitcast_fusion` per layer; -30% tokens/s on 4x4x128), while a
buffer per layer is read in place.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxgpt.model.config import ModelConfig
from jaxgpt.model.layers import EinsumDense
from jaxgpt.ops import kernels

Array = jax.Array
Cache = dict[str, Array]  # one layer's {"k", "v"}: (B, H, S, D); (L, B, H, S, D) when layers are scanned
NEG_INF = float(jnp.finfo(jnp.float32).min)
Blocks = tuple[tuple[int, int, int], ...]  # (t0, t1, s1) per query block, `query_blocks`


def query_blocks(T: int, S: int, causal: bool) -> Blocks:
    """Row blocks (t0, t1, s1) of causal attention: queries t0..t1 need only keys 0..s1 = t1.

    Without a cache the visible keys are always a subset of the causal ones, so splitting the queries
    into blocks and giving each block only its prefix of keys skips the masked upper triangle: about
    40% of the attention FLOPs and of the (T, S) memory traffic, which dominates small models on CPUs.
    Blocks of max(64, T / 8) queries were the fastest of the sizes tried on a 2-core CPU (T = 256 and
    1024); the "one query block" row of benchmarks/bench_train.py shows the gain. Shorter or
    indivisible sequences, and decoding against a cache, use one block.
    """
    block = max(64, T // 8)
    n_blocks, ragged = divmod(T, block)
    if not causal or T != S or n_blocks < 2 or ragged:
        return ((0, T, S),)
    return tuple((t0, t0 + block, t0 + block) for t0 in range(0, T, block))


def scaled_queries(q_BTHD: Array, dtype: str) -> Array:
    """Head-major queries times 1/sqrt(D): scaling the (T, D) queries costs less than the (T, S) scores."""
    scaled = q_BTHD.astype(jnp.float32) / math.sqrt(q_BTHD.shape[-1])
    return scaled.astype(dtype).transpose(0, 2, 1, 3)


def work_dtype(dtype: str) -> str:
    """The dtype of attention's products, softmax inputs and KV cache: the model's, but float32 on CPUs.

    XLA:CPU has no native 16-bit product with batch axes (heads) nor a one-query product against a
    cache: it converts their operands to float32 anyway. In training, the 16-bit roundings between
    them (of q, k and v on their way in and of their gradients on the way out) became slow elementwise
    passes; float32 made a bf16 step of 6x6x384 about 10% faster (benchmarks/bench_train.py). In
    decoding, a bf16 cache was converted whole on every token and rewritten on every write, which cost
    a bf16 decode step more than the halved cache saved (benchmarks/bench_sample.py). Accelerators keep
    the model's dtype.
    """
    narrow = jnp.dtype(dtype).itemsize < 4 and kernels.current_platform() == "cpu"
    return "float32" if narrow else dtype


def resolve_impl(impl: str, dtype: str) -> str:
    """The path "auto" means on the platform being traced for; other names unchanged.

    TPU: splash. NVIDIA GPU: cuDNN flash attention, which needs 16-bit inputs (XLA's otherwise). CPU: einsum,
    the fastest measured there (benchmarks/bench_train.py: its causal query blocks beat XLA's attention).
    """
    if impl != "auto":
        return impl
    platform = kernels.current_platform()
    if platform == "tpu":
        return "splash"
    if platform in ("gpu", "cuda"):
        return "cudnn" if dtype in ("bfloat16", "float16") else "xla"
    return "einsum"


def _block_probs(q_BHTD: Array, k_BHSD: Array, visible_BTS: Array, block: tuple[int, int, int]) -> Array:
    """Float32 softmax probabilities of one query block over its prefix of keys."""
    t0, t1, s1 = block
    att_BHTS = jnp.einsum("bhtd,bhsd->bhts", q_BHTD[:, :, t0:t1], k_BHSD[:, :, :s1]).astype(jnp.float32)
    return jax.nn.softmax(jnp.where(visible_BTS[:, None, t0:t1, :s1], att_BHTS, NEG_INF), axis=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _blocked(q_BHTD: Array, k_BHSD: Array, v_BHSD: Array, visible_BTS: Array, blocks: Blocks) -> Array:
    """softmax(q k^T) v per query block, with a backward written out block by block.

    Autodiff's backward of the block slices is a chain of pads and adds over every block's key and value
    gradients, which XLA:CPU fused with the transposes back to the qkv projection into one slow loop
    (12 ms per layer of a bf16 6x6x384 step). Here each key block's gradient sums only the query blocks
    that see it, and the float32 softmax gradient is formed once per block.
    """
    return _blocked_fwd(q_BHTD, k_BHSD, v_BHSD, visible_BTS, blocks)[0]


def _blocked_fwd(q_BHTD: Array, k_BHSD: Array, v_BHSD: Array, visible_BTS: Array, blocks: Blocks
                 ) -> tuple[Array, tuple]:
    probs = [_block_probs(q_BHTD, k_BHSD, visible_BTS, b) for b in blocks]
    y_BHTD = jnp.concatenate([jnp.einsum("bhts,bhsd->bhtd", p.astype(v_BHSD.dtype), v_BHSD[:, :, :s1])
                              for p, (_, _, s1) in zip(probs, blocks, strict=True)], axis=2)
    return y_BHTD, (q_BHTD, k_BHSD, v_BHSD, probs)


def _blocked_bwd(blocks: Blocks, res: tuple, dy_BHTD: Array) -> tuple[Array, Array, Array, None]:
    q_BHTD, k_BHSD, v_BHSD, probs = res
    dt = q_BHTD.dtype
    dq_parts, dk_parts, dv_parts = [], [], []
    for p_BHTS, (t0, t1, s1) in zip(probs, blocks, strict=True):
        dy = dy_BHTD[:, :, t0:t1]
        dv_parts.append(jnp.einsum("bhts,bhtd->bhsd", p_BHTS.astype(dt), dy, preferred_element_type=jnp.float32))
        dp_BHTS = jnp.einsum("bhtd,bhsd->bhts", dy, v_BHSD[:, :, :s1], preferred_element_type=jnp.float32)
        ds_BHTS = (p_BHTS * (dp_BHTS - jnp.sum(p_BHTS * dp_BHTS, axis=-1, keepdims=True))).astype(dt)
        dq_parts.append(jnp.einsum("bhts,bhsd->bhtd", ds_BHTS, k_BHSD[:, :, :s1]))
        dk_parts.append(jnp.einsum("bhts,bhtd->bhsd", ds_BHTS, q_BHTD[:, :, t0:t1],
                                   preferred_element_type=jnp.float32))

    def prefix_sum(parts: list[Array]) -> Array:  # keys s0..s1 of block j: the parts of query blocks j, j+1, ...
        ends = [s1 for _, _, s1 in blocks]
        return jnp.concatenate([sum(part[:, :, s0:s1] for part in parts[j:])
                                for j, (s0, s1) in enumerate(zip([0, *ends[:-1]], ends, strict=True))], axis=2)

    return (jnp.concatenate(dq_parts, axis=2), prefix_sum(dk_parts).astype(k_BHSD.dtype),
            prefix_sum(dv_parts).astype(v_BHSD.dtype), None)


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


def attend(q_BTHD: Array, k_BHSD: Array, v_BHSD: Array, visible_BTS: Array, *, impl: str, dtype: str,
           causal: bool, dropout: Callable[[Array], Array] | None = None) -> tuple[Array, str, Array | None]:
    """softmax(q k^T / sqrt(D)) v over the keys `visible_BTS` allows (B or 1 rows).

    `causal` says the visible keys are a subset of the causal ones (no cache), so the einsum path may
    skip the masked triangle. Returns (y, its axes "bhtd" or "bthd", the probabilities (B, H, T, S) on
    the einsum path, else None); `dropout` applies to the probabilities (einsum path only). Splash needs
    a causal step whose shapes tile (`kernels.splash_fits`); other calls (decoding, a one-row init) take
    the XLA path.
    """
    B, T, H, _ = q_BTHD.shape
    if impl == "splash" and causal and kernels.splash_fits(B, H, T):
        y = kernels.splash_attention(scaled_queries(q_BTHD, dtype), k_BHSD.astype(dtype), v_BHSD.astype(dtype),
                                     kernels.padding_segments(visible_BTS))
        return y, "bhtd", None
    if impl != "einsum":  # XLA's fused attention, or cuDNN's flash attention on GPUs; they take (B, S, H, D)
        # One mask row for the batch under `causal` is exactly the causal triangle: say so (cuDNN then skips
        # the masked tiles and computes no mask gradient); padding needs the explicit mask.
        plain_causal = causal and visible_BTS.shape[0] == 1
        y = jax.nn.dot_product_attention(q_BTHD, k_BHSD.transpose(0, 2, 1, 3), v_BHSD.transpose(0, 2, 1, 3),
                                         mask=None if plain_causal else visible_BTS[:, None], is_causal=plain_causal,
                                         implementation="cudnn" if impl == "cudnn" else None)
        return y, "bthd", None
    work = work_dtype(dtype)
    q_BHTD, k_BHSD, v_BHSD = scaled_queries(q_BTHD, work), k_BHSD.astype(work), v_BHSD.astype(work)
    blocks = query_blocks(T=q_BTHD.shape[1], S=k_BHSD.shape[2], causal=causal)
    probs = [_block_probs(q_BHTD, k_BHSD, visible_BTS, block) for block in blocks]
    if dropout is None:
        y_BHTD = _blocked(q_BHTD, k_BHSD, v_BHSD, visible_BTS, blocks)
    else:  # dropped probabilities: autodiff's backward
        y_BHTD = jnp.concatenate([jnp.einsum("bhts,bhsd->bhtd", dropout(p).astype(work), v_BHSD[:, :, :s1])
                                  for p, (_, _, s1) in zip(probs, blocks, strict=True)], axis=2)
    S = k_BHSD.shape[2]
    probs_BHTS = jnp.concatenate([jnp.pad(p, ((0, 0), (0, 0), (0, 0), (0, S - s1)))
                                  for p, (_, _, s1) in zip(probs, blocks, strict=True)], axis=2)
    if jnp.dtype(dtype) == jnp.bfloat16 and kernels.current_platform() == "cpu":
        # heads and head_dim last: XLA:CPU then runs the output projection as a native bf16 product
        # (`layers.projection_dot_general`); accelerators keep the layout their compilers were measured with
        return y_BHTD.transpose(0, 2, 1, 3), "bthd", probs_BHTS
    return y_BHTD, "bhtd", probs_BHTS


def _ordering_zeros(x: Array) -> Array:
    """Zeros shaped like `x` that XLA can only get by computing `x` first (0 * x, NaN-safe).

    Added to a cache write, they order the write after the reads that produced `x`. With no data
    path from those reads to the write, XLA cannot prove the write comes last, and copies the cache
    (twice per layer and token) instead of updating it in place. Elementwise, so a sharded `x` needs
    no communication.
    """
    return jnp.nan_to_num(x * 0)


def attend_one(q_B1HD: Array, k_BH1D: Array, v_BH1D: Array, old_k_BHSD: Array, old_v_BHSD: Array,
               index: Array, dtype: str) -> tuple[Array, Array, Array]:
    """One new token: attend over the cache as it was (slots < index) plus the new key/value.

    The same keys and values as attending over the updated cache, but the updated cache is then only
    written, never read, and the write is ordered after the reads (`_ordering_zeros`), so XLA updates it
    in place; each copy of the cache it made otherwise cost as much as the attention. Returns y (B, H, 1, D)
    and the key and value to write.
    """
    q_BH1D = scaled_queries(q_B1HD, dtype)
    old_BH1S = jnp.einsum("bhtd,bhsd->bhts", q_BH1D, old_k_BHSD.astype(dtype)).astype(jnp.float32)
    old_BH1S = jnp.where(jnp.arange(old_BH1S.shape[-1]) < index, old_BH1S, NEG_INF)
    self_BH11 = jnp.einsum("bhtd,bhtd->bht", q_BH1D, k_BH1D.astype(dtype)).astype(jnp.float32)[..., None]
    probs = jax.nn.softmax(jnp.concatenate([old_BH1S, self_BH11], axis=-1), axis=-1)
    y_BH1D = (jnp.einsum("bhts,bhsd->bhtd", probs[..., :-1].astype(dtype), old_v_BHSD.astype(dtype))
              + probs[..., -1:].astype(dtype) * v_BH1D.astype(dtype))
    zeros_BH1D = _ordering_zeros(y_BH1D)
    return y_BH1D, k_BH1D + zeros_BH1D, v_BH1D + zeros_BH1D


def write_cache(cache: Cache, k_BHTD: Array, v_BHTD: Array, index: Array) -> Cache:
    """The layer's cache with T new keys/values written at slots index..index+T-1 (in the cache's dtype)."""
    return {name: jax.lax.dynamic_update_slice_in_dim(cache[name], new.astype(cache[name].dtype), index, 2)
            for name, new in (("k", k_BHTD), ("v", v_BHTD))}


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

    @nn.compact
    def __call__(self, x_BTC: Array, visible_BTS: Array, deterministic: bool, cache: Cache | None = None,
                 cache_index: Array | None = None) -> tuple[Array, Cache | None]:
        cfg = self.cfg
        H, D, C = cfg.n_head, cfg.head_dim, cfg.n_embd
        work = work_dtype(cfg.dtype)  # q, k, v, the cache and one-token attention
        qkv = EinsumDense(cfg, "btc,ckhd->btkhd", (C, 3, H, D), ("embed", None, "heads", "head_dim"),
                          (None, "heads", "head_dim"), fans=(C, H * D), out_dtype=work, name="qkv")(x_BTC)
        q_BTHD = qkv[:, :, 0]
        k_BHSD, v_BHSD = qkv[:, :, 1].transpose(0, 2, 1, 3), qkv[:, :, 2].transpose(0, 2, 1, 3)
        impl = resolve_impl(cfg.attention_impl, cfg.dtype)
        if cache is not None and x_BTC.shape[1] == 1 and impl == "einsum":
            y, k_new, v_new = attend_one(q_BTHD, k_BHSD, v_BHSD, cache["k"], cache["v"], cache_index, work)
            return self._out(y, "bhtd"), write_cache(cache, k_new, v_new, cache_index)
        if cache is not None:  # write this step's keys/values at cache_index, attend over the whole cache
            cache = write_cache(cache, k_BHSD, v_BHSD, cache_index)
            k_BHSD, v_BHSD = cache["k"], cache["v"]
        drop = nn.Dropout(cfg.attn_dropout)
        y, axes, probs = attend(q_BTHD, k_BHSD, v_BHSD, visible_BTS, impl=impl, dtype=cfg.dtype,
                                causal=cache is None,
                                dropout=None if deterministic or not cfg.attn_dropout
                                else lambda p: drop(p, deterministic=False))
        if probs is not None:
            self.sow("intermediates", "attn_weights", probs)  # dropped unless asked for
        return self._out(y, axes), cache

    def _out(self, y: Array, axes: str) -> Array:
        cfg = self.cfg
        return EinsumDense(cfg, f"{axes},hdc->btc", (cfg.n_head, cfg.head_dim, cfg.n_embd),
                           ("heads", "head_dim", "embed"), ("embed",), residual=True,
                           fans=(cfg.n_head * cfg.head_dim, cfg.n_embd), name="out")(y)
