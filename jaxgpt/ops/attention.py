"""Attention as each backend runs it fastest: the one attention function the model calls (`attend`).

Shapes: B batch, T queries, S keys (the cache length when decoding), H heads, D head_dim, K key/value heads
(H, or fewer with grouped-query attention), G = H / K query heads per key/value head.

Paths (`attention_impl`): "einsum" (products and a float32 softmax, per causal query block, with a
hand-written backward), "xla" (`jax.nn.dot_product_attention`), "cudnn" (its cuDNN flash attention), "splash"
(TPU flash attention, `jaxgpt.ops.splash`). "auto" picks per platform (`resolve_impl`). Decoding one token
against a cache has paths of its own (`attend_one`, `attend_written`, `jaxgpt.ops.decode_attention`). On CPUs
the einsum path computes in float32 whatever the model's dtype (`work_dtype`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxgpt.ops import decode_attention, splash
from jaxgpt.ops.platform import current_platform, is_gpu, on_gpu

Array = jax.Array
Cache = dict[str, Array]  # one layer's {"k", "v"}: (B, K, S, D); (L, B, K, S, D) when layers are scanned
NEG_INF = float(jnp.finfo(jnp.float32).min)
Blocks = tuple[tuple[int, int, int], ...]  # (t0, t1, s1) per query block, `query_blocks`


class Scores(NamedTuple):
    """How a layer's attention scores differ from softmax(q.k / sqrt(D)) over the causal keys.

    `scale` replaces 1/sqrt(D) (query_scale); `softcap` bounds the scaled scores to cap * tanh(s / cap) before the
    mask (attn_softcap: the einsum path only); `windowed` says `visible_BTS` may also hide older keys (a
    sliding window), so no path may assume the plain causal triangle and one new token reads the mask too.
    """

    scale: float | None = None
    softcap: float | None = None
    windowed: bool = False

    @property
    def plain(self) -> bool:
        return self == PLAIN


PLAIN = Scores()  # softmax(q.k / sqrt(D)) over the causal keys


def soft_capped(s: Array, softcap: float | None) -> Array:
    """Scores bounded smoothly to (-cap, cap) (`Scores.softcap`), unchanged without a cap."""
    return s if softcap is None else softcap * jnp.tanh(s / softcap)


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


def scaled_queries(q_BTHD: Array, dtype: str, scale: float | None = None) -> Array:
    """Head-major queries times 1/sqrt(D) (or `scale`): scaling the (T, D) queries costs less than the (T, S)
    scores."""
    q32 = q_BTHD.astype(jnp.float32)
    scaled = q32 / math.sqrt(q_BTHD.shape[-1]) if scale is None else q32 * scale
    return scaled.astype(dtype).transpose(0, 2, 1, 3)


def query_rows(q_BHTD: Array, K: int) -> Array:
    """Queries by the key/value head they read: (B, K, R, D), R = T G rows per key/value head, row t G + g being
    token t's query head k G + g (G = H / K).

    Grouped-query attention's G query heads of one key/value head thus form one product with its keys and
    values as they are, instead of against keys and values repeated G times; a causal block of tokens stays a
    block of rows. With G = 1 (multi-head attention) the queries are as given.
    """
    B, H, T, D = q_BHTD.shape
    return q_BHTD.reshape(B, K, H // K, T, D).transpose(0, 1, 3, 2, 4).reshape(B, K, T * (H // K), D)


def heads_of_rows(x_BKRX: Array, H: int) -> Array:
    """The inverse of `query_rows` for its results: (B, K, T G, X) -> (B, H, T, X)."""
    B, K, R, X = x_BKRX.shape
    G = H // K
    return x_BKRX.reshape(B, K, R // G, G, X).transpose(0, 1, 3, 2, 4).reshape(B, H, R // G, X)


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


def resolve_impl(impl: str, dtype: str, scores: Scores = PLAIN) -> str:
    """The path "auto" means on the platform being traced for; other names unchanged.

    TPU: splash. NVIDIA GPU: cuDNN flash attention, which needs 16-bit inputs (XLA's otherwise). CPU: einsum,
    the fastest measured there (benchmarks/bench_train.py: its causal query blocks beat XLA's attention). Only
    the einsum path soft-caps scores, and splash has no window: such `scores` take einsum, or XLA's on a TPU.
    """
    if impl != "auto":
        return impl
    platform = current_platform()
    if scores.softcap is not None:
        return "einsum"
    if platform == "tpu":
        return "xla" if scores.windowed else "splash"
    if is_gpu(platform):
        return "cudnn" if dtype in ("bfloat16", "float16") else "xla"
    return "einsum"


def _block_probs(q_BKRD: Array, k_BKSD: Array, visible_BRS: Array, block: tuple[int, int, int],
                 softcap: float | None = None) -> Array:
    """Float32 softmax probabilities of one block of query rows over its prefix of keys."""
    r0, r1, s1 = block
    att_BKRS = jnp.einsum("bhtd,bhsd->bhts", q_BKRD[:, :, r0:r1], k_BKSD[:, :, :s1]).astype(jnp.float32)
    att_BKRS = soft_capped(att_BKRS, softcap)
    return jax.nn.softmax(jnp.where(visible_BRS[:, None, r0:r1, :s1], att_BKRS, NEG_INF), axis=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _blocked(q_BKRD: Array, k_BKSD: Array, v_BKSD: Array, visible_BRS: Array, blocks: Blocks) -> Array:
    """softmax(q k^T) v per query block, with a backward written out block by block.

    Autodiff's backward of the block slices is a chain of pads and adds over every block's key and value
    gradients, which XLA:CPU fused with the transposes back to the qkv projection into one slow loop
    (benchmarks/bench_train.py's bf16 step). Here each key block's gradient sums only the query blocks
    that see it, and the float32 softmax gradient is formed once per block. The G query heads of a key/value
    head are rows of its queries (`query_rows`), so its gradient sums theirs.
    """
    return _blocked_fwd(q_BKRD, k_BKSD, v_BKSD, visible_BRS, blocks)[0]


def _blocked_fwd(q_BKRD: Array, k_BKSD: Array, v_BKSD: Array, visible_BRS: Array, blocks: Blocks
                 ) -> tuple[Array, tuple]:
    probs = [_block_probs(q_BKRD, k_BKSD, visible_BRS, b) for b in blocks]
    y_BKRD = jnp.concatenate([jnp.einsum("bhts,bhsd->bhtd", p.astype(v_BKSD.dtype), v_BKSD[:, :, :s1])
                              for p, (_, _, s1) in zip(probs, blocks, strict=True)], axis=2)
    return y_BKRD, (q_BKRD, k_BKSD, v_BKSD, probs)


def _blocked_bwd(blocks: Blocks, res: tuple, dy_BKRD: Array) -> tuple[Array, Array, Array, None]:
    q_BKRD, k_BKSD, v_BKSD, probs = res
    dt = q_BKRD.dtype
    dq_parts, dk_parts, dv_parts = [], [], []
    for p_BKRS, (r0, r1, s1) in zip(probs, blocks, strict=True):
        dy = dy_BKRD[:, :, r0:r1]
        dv_parts.append(jnp.einsum("bhts,bhtd->bhsd", p_BKRS.astype(dt), dy, preferred_element_type=jnp.float32))
        dp_BKRS = jnp.einsum("bhtd,bhsd->bhts", dy, v_BKSD[:, :, :s1], preferred_element_type=jnp.float32)
        ds_BKRS = (p_BKRS * (dp_BKRS - jnp.sum(p_BKRS * dp_BKRS, axis=-1, keepdims=True))).astype(dt)
        dq_parts.append(jnp.einsum("bhts,bhsd->bhtd", ds_BKRS, k_BKSD[:, :, :s1]))
        dk_parts.append(jnp.einsum("bhts,bhtd->bhsd", ds_BKRS, q_BKRD[:, :, r0:r1],
                                   preferred_element_type=jnp.float32))

    def prefix_sum(parts: list[Array]) -> Array:  # keys s0..s1 of block j: the parts of query blocks j, j+1, ...
        ends = [s1 for _, _, s1 in blocks]
        return jnp.concatenate([sum(part[:, :, s0:s1] for part in parts[j:])
                                for j, (s0, s1) in enumerate(zip([0, *ends[:-1]], ends, strict=True))], axis=2)

    return (jnp.concatenate(dq_parts, axis=2), prefix_sum(dk_parts).astype(k_BKSD.dtype),
            prefix_sum(dv_parts).astype(v_BKSD.dtype), None)


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


def attend(q_BTHD: Array, k_BKSD: Array, v_BKSD: Array, visible_BTS: Array, *, impl: str, dtype: str,
           causal: bool, dropout: Callable[[Array], Array] | None = None, cache: Cache | None = None,
           cache_index: Array | None = None, scores: Scores = PLAIN) -> tuple[Array, Array | None, Cache | None]:
    """softmax(q k^T / sqrt(D)) v over the keys `visible_BTS` allows (B or 1 rows): the model's one attention.

    Keys and values have K heads, K dividing the H query heads (grouped-query attention when K < H: query
    heads k G .. (k + 1) G - 1 read key/value head k, G = H / K); no path repeats them to H heads.
    `causal` says the visible keys are a subset of the causal ones, so the einsum path may skip the masked
    triangle and splash may run. With a `cache` ({"k", "v"}: (B, K, S, D)), this call's keys and values are
    written at `cache_index` and the queries attend over the whole cache (one new token: `_one_new_token`).
    `impl` is the model's `attention_impl` ("auto": `resolve_impl`). Returns (y (B, T, H, D), the
    probabilities (B, H, T, S) on the einsum path else None, the updated cache or None); `dropout` applies
    to the probabilities (einsum path only). Splash needs a causal step whose shapes tile
    (`splash.splash_fits`) and one key/value head per query head; other calls (a prefill, a one-row init,
    grouped queries) take the XLA path, whose kernels (XLA's and cuDNN's) take fewer key/value heads as they are.
    `scores`: a query scale, a soft-cap and a sliding window (`Scores`).
    """
    impl = resolve_impl(impl, dtype, scores)
    if cache is not None and q_BTHD.shape[1] == 1:
        return _one_new_token(q_BTHD, k_BKSD, v_BKSD, cache, cache_index, impl, dtype, scores, visible_BTS)
    if cache is not None:  # write this step's keys/values at cache_index, attend over the whole cache
        cache = write_cache(cache, k_BKSD, v_BKSD, cache_index)
        k_BKSD, v_BKSD, causal = cache["k"], cache["v"], False
    B, T, H, _ = q_BTHD.shape
    if impl == "splash" and causal and not scores.windowed and k_BKSD.shape[1] == H and splash.splash_fits(B, H, T):
        y_BHTD = splash.splash_attention(scaled_queries(q_BTHD, dtype, scores.scale), k_BKSD.astype(dtype),
                                         v_BKSD.astype(dtype), splash.padding_segments(visible_BTS, B))
        return y_BHTD.transpose(0, 2, 1, 3), None, cache
    if impl != "einsum":  # XLA's fused attention, or cuDNN's flash attention on GPUs; they take (B, S, K, D)
        # The plain causal triangle (`splash.plain_causal`): say so (cuDNN then skips the masked tiles and
        # computes no mask gradient); padding and packed documents need the explicit mask.
        plain_causal = causal and not scores.windowed and splash.plain_causal(visible_BTS, B)
        y_BTHD = jax.nn.dot_product_attention(
            q_BTHD, k_BKSD.transpose(0, 2, 1, 3), v_BKSD.transpose(0, 2, 1, 3),
            mask=None if plain_causal else visible_BTS[:, None], is_causal=plain_causal, scale=scores.scale,
            implementation="cudnn" if impl == "cudnn" else None)
        return y_BTHD, None, cache
    y_BHTD, probs_BHTS = _einsum_attention(q_BTHD, k_BKSD, v_BKSD, visible_BTS, dtype, causal, dropout, scores)
    # heads and head_dim last: the output projection then reads them as its contracted axes, which on
    # XLA:CPU makes a bf16 one a native product (`projection.projection_dot_general`); XLA folds the
    # transpose into the product elsewhere (the same compiled program as contracting (h, d) of y_BHTD)
    return y_BHTD.transpose(0, 2, 1, 3), probs_BHTS, cache


def _einsum_attention(q_BTHD: Array, k_BKSD: Array, v_BKSD: Array, visible_BTS: Array, dtype: str, causal: bool,
                      dropout: Callable[[Array], Array] | None, scores: Scores) -> tuple[Array, Array]:
    """The einsum path: per query block (`query_blocks`) in the work dtype; (y (B, H, T, D), probs (B, H, T, S)).

    Soft-capped scores take autodiff's backward, as dropped probabilities do (`_blocked`'s is softmax's alone).
    """
    work = work_dtype(dtype)
    _, T, H, _ = q_BTHD.shape
    K, S = k_BKSD.shape[1], k_BKSD.shape[2]
    G = H // K  # each token's G query heads are G rows (`query_rows`): its visibility too, blocks of G T rows
    q_BKRD = query_rows(scaled_queries(q_BTHD, work, scores.scale), K)
    visible_BRS = jnp.repeat(visible_BTS, G, axis=1) if G > 1 else visible_BTS
    blocks = tuple((t0 * G, t1 * G, s1) for t0, t1, s1 in query_blocks(T=T, S=S, causal=causal))
    k_BKSD, v_BKSD = k_BKSD.astype(work), v_BKSD.astype(work)
    probs = [_block_probs(q_BKRD, k_BKSD, visible_BRS, block, scores.softcap) for block in blocks]
    if dropout is None and scores.softcap is None:
        y_BKRD = _blocked(q_BKRD, k_BKSD, v_BKSD, visible_BRS, blocks)
    else:  # dropped probabilities or capped scores: autodiff's backward
        dropout = dropout or (lambda p: p)
        y_BKRD = jnp.concatenate([jnp.einsum("bhts,bhsd->bhtd", dropout(p).astype(work), v_BKSD[:, :, :s1])
                                  for p, (_, _, s1) in zip(probs, blocks, strict=True)], axis=2)
    probs_BKRS = jnp.concatenate([jnp.pad(p, ((0, 0), (0, 0), (0, 0), (0, S - s1)))
                                  for p, (_, _, s1) in zip(probs, blocks, strict=True)], axis=2)
    return heads_of_rows(y_BKRD, H), heads_of_rows(probs_BKRS, H)


def _ordering_zeros(x: Array) -> Array:
    """Zeros shaped like `x` that XLA can only get by computing `x` first (0 * x, NaN-safe).

    Added to a cache write, they order the write after the reads that produced `x`. With no data
    path from those reads to the write, XLA cannot prove the write comes last, and copies the cache
    (twice per layer and token) instead of updating it in place. Elementwise, so a sharded `x` needs
    no communication.
    """
    return jnp.nan_to_num(x * 0)


def attend_one(q_B1HD: Array, k_BK1D: Array, v_BK1D: Array, old_k_BKSD: Array, old_v_BKSD: Array,
               index: Array, dtype: str, scores: Scores = PLAIN, visible_B1S: Array | None = None
               ) -> tuple[Array, Array, Array]:
    """One new token on CPUs: attend over the cache as it was (slots < index) plus the new key/value.

    The same keys and values as attending over the updated cache, but the updated cache is then only
    written, never read, and the write is ordered after the reads (`_ordering_zeros`), so XLA:CPU updates it
    in place; each copy of the cache it made otherwise cost as much as the attention. The G query heads of
    a key/value head are its G query rows (`query_rows`). Returns y (B, H, 1, D) and the key and value to
    write (B, K, 1, D). A windowed layer (`Scores.windowed`) also hides the old keys `visible_B1S` hides.
    """
    H, K = q_B1HD.shape[2], k_BK1D.shape[1]
    q_BKGD = query_rows(scaled_queries(q_B1HD, dtype, scores.scale), K)
    old_BKGS = jnp.einsum("bhtd,bhsd->bhts", q_BKGD, old_k_BKSD.astype(dtype)).astype(jnp.float32)
    old_S = jnp.arange(old_BKGS.shape[-1]) < index
    old_BKGS = jnp.where(old_S & visible_B1S[:, None] if scores.windowed else old_S,
                         soft_capped(old_BKGS, scores.softcap), NEG_INF)
    k_BKGD = jnp.broadcast_to(k_BK1D, q_BKGD.shape)  # the one new key per query row: G copies of a (D,) vector
    self_BKG1 = soft_capped(jnp.einsum("bhtd,bhtd->bht", q_BKGD, k_BKGD.astype(dtype)).astype(jnp.float32)[..., None],
                            scores.softcap)
    probs = jax.nn.softmax(jnp.concatenate([old_BKGS, self_BKG1], axis=-1), axis=-1)
    y_BKGD = (jnp.einsum("bhts,bhsd->bhtd", probs[..., :-1].astype(dtype), old_v_BKSD.astype(dtype))
              + probs[..., -1:].astype(dtype) * v_BK1D.astype(dtype))
    zeros_BK1D = _ordering_zeros(y_BKGD[:, :, :1])
    return heads_of_rows(y_BKGD, H), k_BK1D + zeros_BK1D, v_BK1D + zeros_BK1D


def attend_written(q_B1HD: Array, k_BKSD: Array, v_BKSD: Array, index: Array, dtype: str,
                   scores: Scores = PLAIN, visible_B1S: Array | None = None) -> Array:
    """One new token on accelerators, against a cache it was already written into (slots <= index): y (B, H, 1, D).

    XLA:GPU updates the cache in place either way, and attending over the written cache spares `attend_one`'s
    separate product with the new key, the concatenation of its score and the sum of two value products: a
    batch-1 GPT-2 token launched 278.5 kernels with `attend_one`, 206.5 with this (tests/compile/test_decode_program.py;
    218 and 169 at batch 64). G query heads per key/value head, `scores` and `visible_B1S` as in `attend_one`.
    """
    H, K = q_B1HD.shape[2], k_BKSD.shape[1]
    q_BKGD = query_rows(scaled_queries(q_B1HD, dtype, scores.scale), K)
    s_BKGS = jnp.einsum("bhtd,bhsd->bhts", q_BKGD, k_BKSD.astype(dtype)).astype(jnp.float32)
    written_S = jnp.arange(s_BKGS.shape[-1]) <= index
    s_BKGS = jnp.where(written_S & visible_B1S[:, None] if scores.windowed else written_S,
                       soft_capped(s_BKGS, scores.softcap), NEG_INF)
    probs = jax.nn.softmax(s_BKGS, axis=-1)
    y_BKGD = jnp.einsum("bhts,bhsd->bhtd", probs.astype(dtype), v_BKSD.astype(dtype))
    return heads_of_rows(y_BKGD, H)


def _one_new_token(q_B1HD: Array, k_BK1D: Array, v_BK1D: Array, cache: Cache, index: Array, impl: str,
                   dtype: str, scores: Scores, visible_B1S: Array) -> tuple[Array, None, Cache]:
    """`attend` for one new token against a cache: (y (B, 1, H, D), None, the cache with the token written).

    It takes a path of its own: cuDNN's attention has nothing to fuse in one query row and fails under vmap, which
    the serving engine decodes its slots with (its batching rule reshapes the broadcast mask into a per-head bias
    of the wrong size; jax 0.11.2, H100). CPUs attend over the cache as it was plus the new key (`attend_one`);
    where cuDNN's attention would run, one Pallas kernel writes the cache and attends (`decode_attention`);
    elsewhere the cache is written, then attended over (`attend_written`).
    """
    H, K = q_B1HD.shape[2], k_BK1D.shape[1]
    if current_platform() == "cpu":
        y_BH1D, k_new, v_new = attend_one(q_B1HD, k_BK1D, v_BK1D, cache["k"], cache["v"], index, work_dtype(dtype),
                                          scores, visible_B1S)
        return y_BH1D.transpose(0, 2, 1, 3), None, write_cache(cache, k_new, v_new, index)
    if one_kernel_decode(impl, H, K, q_B1HD.shape[3], scores):
        y_BKGD, k_cache, v_cache = decode_attention.decode_attention(
            query_rows(q_B1HD.transpose(0, 2, 1, 3), K), k_BK1D[:, :, 0], v_BK1D[:, :, 0], cache["k"], cache["v"],
            index)
        return heads_of_rows(y_BKGD, H).transpose(0, 2, 1, 3), None, {"k": k_cache, "v": v_cache}
    cache = write_cache(cache, k_BK1D, v_BK1D, index)
    y_BH1D = attend_written(q_B1HD, cache["k"], cache["v"], index, work_dtype(dtype), scores, visible_B1S)
    return y_BH1D.transpose(0, 2, 1, 3), None, cache


def attend_qkv(qkv_B13HD: Array, cache: Cache, index: Array, impl: str, dtype: str,
               scores: Scores = PLAIN) -> tuple[Array, Cache] | None:
    """One new token's multi-head attention straight from its fused projection (B, 1, 3, H, D), as `attend` with
    its three parts would give, where that is one kernel (`one_kernel_decode`): (y (B, 1, H, D), the cache with the
    token written); None elsewhere, where the caller splits it for `attend`.

    The kernel reads the three parts from the projection as it is (`decode_attention.decode_attention_qkv`), so
    XLA computes the projection as one fusion: with XLA's Triton fusion a batch-1 GPT-2 token launched 103 kernels
    when the kernel took three slices of it, each a fusion of its own, and 79 this way
    (tests/compile/test_decode_program.py).
    """
    H, D = qkv_B13HD.shape[3:]
    if qkv_B13HD.shape[1] != 1 or not one_kernel_decode(resolve_impl(impl, dtype, scores), H, H, D, scores):
        return None
    y_BH1D, k_cache, v_cache = decode_attention.decode_attention_qkv(qkv_B13HD[:, 0], cache["k"], cache["v"], index)
    return y_BH1D.transpose(0, 2, 1, 3), {"k": k_cache, "v": v_cache}


def one_kernel_decode(impl: str, H: int, K: int, D: int, scores: Scores = PLAIN) -> bool:
    """Whether one new token's attention runs as one kernel (`decode_attention`): where the model's attention is
    cuDNN's (`resolve_impl`: "auto" in 16 bits on an NVIDIA GPU, or named), so "xla" keeps XLA's own decoding;
    on one device (a Pallas kernel is not partitioned: a mesh of several would gather its operands); for head
    shapes the kernel takes; for plain scores (the kernel scales by 1/sqrt(D), with no cap and no window)."""
    mesh = jax.sharding.get_abstract_mesh()
    return (impl == "cudnn" and scores.plain and on_gpu() and (mesh.empty or mesh.size == 1)
            and decode_attention.fits(H // K, D))


def write_cache(cache: Cache, k_BHTD: Array, v_BHTD: Array, index: Array) -> Cache:
    """The layer's cache with T new keys/values written at slots index..index+T-1 (in the cache's dtype)."""
    return {name: jax.lax.dynamic_update_slice_in_dim(cache[name], new.astype(cache[name].dtype), index, 2)
            for name, new in (("k", k_BHTD), ("v", v_BHTD))}
