"""Attention as each backend runs it fastest: the one attention function the model calls (`attend`).

Shapes: B batch, T queries, S keys (the cache length when decoding), H heads, D head_dim.

Paths (`attention_impl`): "einsum" (products and a float32 softmax, per causal query block, with a
hand-written backward), "xla" (`jax.nn.dot_product_attention`), "cudnn" (its cuDNN flash attention), "splash"
(TPU flash attention, `jaxgpt.ops.splash`). "auto" picks per platform (`resolve_impl`). Decoding one token
against a cache has a path of its own (`attend_one`). On CPUs the einsum path computes in float32 whatever the
model's dtype (`work_dtype`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxgpt.ops import splash
from jaxgpt.ops.platform import current_platform

Array = jax.Array
Cache = dict[str, Array]  # one layer's {"k", "v"}: (B, H, S, D); (L, B, H, S, D) when layers are scanned
NEG_INF = float(jnp.finfo(jnp.float32).min)
Blocks = tuple[tuple[int, int, int], ...]  # (t0, t1, s1) per query block, `query_blocks`


def query_blocks(T: int, S: int, causal: bool) -> Blocks:
    """Row blocks (t0, t1, s1) of causal attention: queries t0..t1 need only keys 0..s1 = t1.

    Without a cache the visible keys are always a subset of the causal ones, so splitting the queries
    into blocks and giving each block only its prefix of keys skips the masked upper triangle: nearly
    half of the attention FLOPs and of the (T, S) memory traffic, which dominates small models on CPUs.
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
    passes; float32 made a bf16 step faster (benchmarks/bench_train.py). In
    decoding, a bf16 cache was converted whole on every token and rewritten on every write, which cost
    a bf16 decode step more than the halved cache saved (benchmarks/bench_sample.py). Accelerators keep
    the model's dtype.
    """
    narrow = jnp.dtype(dtype).itemsize < 4 and current_platform() == "cpu"
    return "float32" if narrow else dtype


def resolve_impl(impl: str, dtype: str) -> str:
    """The path "auto" means on the platform being traced for; other names unchanged.

    TPU: splash. NVIDIA GPU: cuDNN flash attention, which needs 16-bit inputs (XLA's otherwise). CPU: einsum,
    the fastest measured there (benchmarks/bench_train.py: its causal query blocks beat XLA's attention).
    """
    if impl != "auto":
        return impl
    platform = current_platform()
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
    (benchmarks/bench_train.py's bf16 step). Here each key block's gradient sums only the query blocks
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
           causal: bool, dropout: Callable[[Array], Array] | None = None, cache: Cache | None = None,
           cache_index: Array | None = None) -> tuple[Array, Array | None, Cache | None]:
    """softmax(q k^T / sqrt(D)) v over the keys `visible_BTS` allows (B or 1 rows): the model's one attention.

    `causal` says the visible keys are a subset of the causal ones, so the einsum path may skip the masked
    triangle and splash may run. With a `cache` ({"k", "v"}: (B, H, S, D)), this call's keys and values are
    written at `cache_index` and the queries attend over the whole cache (one new token: `attend_one`).
    `impl` is the model's `attention_impl` ("auto": `resolve_impl`). Returns (y (B, T, H, D), the
    probabilities (B, H, T, S) on the einsum path else None, the updated cache or None); `dropout` applies
    to the probabilities (einsum path only). Splash needs a causal step whose shapes tile
    (`splash.splash_fits`); other calls (decoding, a one-row init) take the XLA path.
    """
    impl = resolve_impl(impl, dtype)
    if cache is not None and q_BTHD.shape[1] == 1 and impl == "einsum":
        y_BH1D, k_new, v_new = attend_one(q_BTHD, k_BHSD, v_BHSD, cache["k"], cache["v"], cache_index,
                                          work_dtype(dtype))
        return y_BH1D.transpose(0, 2, 1, 3), None, write_cache(cache, k_new, v_new, cache_index)
    if cache is not None:  # write this step's keys/values at cache_index, attend over the whole cache
        cache = write_cache(cache, k_BHSD, v_BHSD, cache_index)
        k_BHSD, v_BHSD, causal = cache["k"], cache["v"], False
    B, T, H, _ = q_BTHD.shape
    if impl == "splash" and causal and splash.splash_fits(B, H, T):
        y_BHTD = splash.splash_attention(scaled_queries(q_BTHD, dtype), k_BHSD.astype(dtype),
                                         v_BHSD.astype(dtype), splash.padding_segments(visible_BTS))
        return y_BHTD.transpose(0, 2, 1, 3), None, cache
    if impl != "einsum":  # XLA's fused attention, or cuDNN's flash attention on GPUs; they take (B, S, H, D)
        # One mask row for the batch under `causal` is exactly the causal triangle: say so (cuDNN then skips
        # the masked tiles and computes no mask gradient); padding needs the explicit mask.
        plain_causal = causal and visible_BTS.shape[0] == 1
        y_BTHD = jax.nn.dot_product_attention(
            q_BTHD, k_BHSD.transpose(0, 2, 1, 3), v_BHSD.transpose(0, 2, 1, 3),
            mask=None if plain_causal else visible_BTS[:, None], is_causal=plain_causal,
            implementation="cudnn" if impl == "cudnn" else None)
        return y_BTHD, None, cache
    y_BHTD, probs_BHTS = _einsum_attention(q_BTHD, k_BHSD, v_BHSD, visible_BTS, dtype, causal, dropout)
    # heads and head_dim last: the output projection then reads them as its contracted axes, which on
    # XLA:CPU makes a bf16 one a native product (`projection.projection_dot_general`); XLA folds the
    # transpose into the product elsewhere (the same compiled program as contracting (h, d) of y_BHTD)
    return y_BHTD.transpose(0, 2, 1, 3), probs_BHTS, cache


def _einsum_attention(q_BTHD: Array, k_BHSD: Array, v_BHSD: Array, visible_BTS: Array, dtype: str, causal: bool,
                      dropout: Callable[[Array], Array] | None) -> tuple[Array, Array]:
    """The einsum path: per query block (`query_blocks`) in the work dtype; (y (B, H, T, D), probs (B, H, T, S))."""
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
    return y_BHTD, probs_BHTS


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
