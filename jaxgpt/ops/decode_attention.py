"""One new token's attention on NVIDIA GPUs as one kernel: the cache write and the attention over the written slots.

Shapes: B batch, K key/value heads, G query heads per key/value head, S cache slots, D head_dim.

XLA:GPU decodes a layer's attention in four kernels (the key's and the value's cache writes, the scores, the
softmax with the value product: tests/compile/test_decode_program.py), and its products read all S slots of the
cache, written or not: with the serving engine's block_size slots per row, a short reply reads the whole cache every
token. `decode_attention` is one Pallas (Triton) kernel per (row, key/value head): it writes the new key and value
at their slot in place (the caches are aliased to its outputs) and runs an online softmax over the written
slots only, block by block up to the row's index, with the new key and value taken from registers. Rows decode
at their own index (the engine's slots), since the kernel is vmapped like any jax function.

Multi-head attention's queries, keys and values come from one fused projection (`model.attention.Attention`'s
`qkv`), and `decode_attention_qkv` reads the three from that array as it is: handed three slices of it, XLA's
Triton fusion computes the projection as one fusion per slice, two kernels a layer more
(tests/compile/test_decode_program.py; its default fusion launches the projection's bias add as a kernel of its own
either way). The queries are scaled by 1/sqrt(D) in the kernel.

It is a Triton kernel: jax 0.12 deprecates Pallas's Triton backend in favour of Mosaic GPU, but its pallas_call
lowers only Triton kernels for GPUs (0.12.0.1); where the backend is gone, decoding takes XLA's path (`fits`).
On a CPU it runs in Pallas interpret mode, which is how tests/unit/ops/test_decode_attention.py proves it equal to
`attention.write_cache` followed by `attention.attend_written`; `attention.attend` runs it on GPUs where it fits
(`fits`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # Pallas's Triton backend; jax 0.12 deprecates it for Mosaic GPU, whose pallas_call it cannot yet lower
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # a jax without it decodes through XLA (`fits`)
    plgpu = None

Array = jax.Array
BLOCK_SLOTS = 64  # cache slots per step of the kernel's loop: a (64, D) tile of keys and one of values
NEG_INF = float(jnp.finfo(jnp.float32).min)


def fits(G: int, D: int) -> bool:
    """Whether the kernel takes G query heads per key/value head of D dims (Triton's tiles are powers of two) on
    this jax (`plgpu`)."""
    return plgpu is not None and G & (G - 1) == 0 and D & (D - 1) == 0 and D >= 16


def _kernel(index_ref: object, q_ref: object, k_ref: object, v_ref: object, k_cache_ref: object,
            v_cache_ref: object, y_ref: object, k_out_ref: object, v_out_ref: object, *, S: int) -> None:
    """One (row, key/value head): G queries against the slots the row has written, then the new slot written.

    The queries are scaled by 1/sqrt(D) here, in float32 (a (D,) query block is one query: G = 1). Slots
    0..index are visible (all S once index >= S); the new key and value go to slot w = min(index, S - 1), where
    `jax.lax.dynamic_update_slice` would write them, and are read from registers, so whatever slot w held before
    takes no part.
    """
    index = index_ref[...]
    w = jnp.minimum(index, S - 1)
    q_GD = q_ref[...].astype(jnp.float32) / math.sqrt(k_ref.shape[-1])
    if q_GD.ndim == 1:
        q_GD = q_GD[None, :]
    k_D, v_D = k_ref[...], v_ref[...]
    m_G = jnp.sum(q_GD * k_D.astype(jnp.float32)[None, :], axis=-1)  # the new key's score starts the softmax
    l_G = jnp.ones_like(m_G)
    acc_GD = jnp.broadcast_to(v_D.astype(jnp.float32)[None, :], q_GD.shape)

    def block(i: Array, carry: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
        m_G, l_G, acc_GD = carry
        s_B = i * BLOCK_SLOTS + jnp.arange(BLOCK_SLOTS)
        inside_B = s_B < S  # the last block may run past the cache
        k_BD = plgpu.load(k_cache_ref.at[pl.ds(i * BLOCK_SLOTS, BLOCK_SLOTS), :], mask=inside_B[:, None], other=0)
        v_BD = plgpu.load(v_cache_ref.at[pl.ds(i * BLOCK_SLOTS, BLOCK_SLOTS), :], mask=inside_B[:, None], other=0)
        s_GB = jnp.sum(q_GD[:, None, :] * k_BD.astype(jnp.float32)[None, :, :], axis=-1)
        s_GB = jnp.where((inside_B & (s_B <= index) & (s_B != w))[None, :], s_GB, NEG_INF)
        m_new = jnp.maximum(m_G, jnp.max(s_GB, axis=-1))
        p_GB = jnp.exp(s_GB - m_new[:, None])
        alpha_G = jnp.exp(m_G - m_new)
        acc_GD = acc_GD * alpha_G[:, None] + jnp.sum(p_GB[:, :, None] * v_BD.astype(jnp.float32)[None, :, :], axis=1)
        return m_new, l_G * alpha_G + jnp.sum(p_GB, axis=-1), acc_GD

    blocks = jnp.minimum(index // BLOCK_SLOTS + 1, pl.cdiv(S, BLOCK_SLOTS))  # the blocks holding slots 0..index
    _, l_G, acc_GD = jax.lax.fori_loop(0, blocks, block, (m_G, l_G, acc_GD))
    y_ref[...] = (acc_GD / l_G[:, None]).astype(y_ref.dtype)
    k_out_ref[pl.ds(w, 1), :] = k_D[None, :].astype(k_out_ref.dtype)
    v_out_ref[pl.ds(w, 1), :] = v_D[None, :].astype(v_out_ref.dtype)


def _row_head(*block: int | None) -> pl.BlockSpec:
    """The block of one (row, key/value head) grid cell of an array whose first two axes are (B, K)."""
    return pl.BlockSpec(block, lambda b, k: (b, k) + (0,) * (len(block) - 2))


def decode_attention(q_BKGD: Array, k_BKD: Array, v_BKD: Array, k_cache_BKSD: Array, v_cache_BKSD: Array,
                     index: Array, *, interpret: bool = False) -> tuple[Array, Array, Array]:
    """(y (B, K, G, D), the key cache, the value cache) with the new key and value written at `index` and the
    queries attending over slots 0..index of each row, in float32 within the kernel.

    `index`: a scalar, the same slot for every row. Within a jitted program whose caches are donated or loop
    carried, XLA writes the one slot of each in place.
    """
    G, D = q_BKGD.shape[2:]
    specs = _row_head(None, None, G, D), _row_head(None, None, D), _row_head(None, None, D)
    return _call((q_BKGD, k_BKD, v_BKD), specs, k_cache_BKSD, v_cache_BKSD, index, G, interpret)


def decode_attention_qkv(qkv_B3KD: Array, k_cache_BKSD: Array, v_cache_BKSD: Array, index: Array, *,
                         interpret: bool = False) -> tuple[Array, Array, Array]:
    """`decode_attention` of multi-head attention (G = 1) with the queries, keys and values the three parts of one
    (B, 3, K, D) array, the fused projection's: y is (B, K, 1, D)."""
    D = qkv_B3KD.shape[-1]
    part = lambda i: pl.BlockSpec((None, None, None, D), lambda b, k: (b, i, k, 0))
    return _call((qkv_B3KD,) * 3, (part(0), part(1), part(2)), k_cache_BKSD, v_cache_BKSD, index, 1, interpret)


def _call(qkv: tuple[Array, Array, Array], qkv_specs: tuple[pl.BlockSpec, ...], k_cache_BKSD: Array,
          v_cache_BKSD: Array, index: Array, G: int, interpret: bool) -> tuple[Array, Array, Array]:
    """The kernel over a (B, K) grid, the queries, keys and values read through `qkv_specs`."""
    B, K, S, D = k_cache_BKSD.shape
    index_B = jnp.broadcast_to(jnp.asarray(index, jnp.int32), (B,))
    cache_spec = _row_head(None, None, S, D)
    return pl.pallas_call(
        functools.partial(_kernel, S=S),
        grid=(B, K),
        in_specs=[pl.BlockSpec((None,), lambda b, k: (b,)), *qkv_specs, cache_spec, cache_spec],
        out_specs=[_row_head(None, None, G, D), cache_spec, cache_spec],
        out_shape=[jax.ShapeDtypeStruct((B, K, G, D), qkv[0].dtype),
                   jax.ShapeDtypeStruct(k_cache_BKSD.shape, k_cache_BKSD.dtype),
                   jax.ShapeDtypeStruct(v_cache_BKSD.shape, v_cache_BKSD.dtype)],
        input_output_aliases={4: 1, 5: 2},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="decode_attention",
    )(index_B, *qkv, k_cache_BKSD, v_cache_BKSD)
