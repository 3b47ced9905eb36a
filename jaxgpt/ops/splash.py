"""Splash attention: TPU flash attention, and its cost for the ahead-of-time analysis.

Shapes: B batch, H heads, T sequence, D head_dim.

Splash (`jax.experimental.pallas.ops.tpu.splash_attention`, in jax itself) skips the causal tiles above the
diagonal and never writes the (B, H, T, T) scores to HBM. It runs per device under `jax.shard_map`, rows
split like the batch and heads like the "heads" logical axis, so the same code serves one chip and a pod.
On a CPU it runs in Pallas interpret mode (slow, exact), which is how the tests prove its numbers.
`jaxgpt.ops.attention.attend` decides when it runs.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxgpt.ops.platform import current_platform

Array = jax.Array
SPLASH_BLOCKS = (512, 256, 128)  # TPU tiles are multiples of 128 lanes; 512 is MaxText's default tile


def splash_block(T: int) -> int | None:
    """Queries and keys per splash tile for sequences of T: the largest of 512, 256, 128 dividing T."""
    return next((b for b in SPLASH_BLOCKS if T % b == 0), None)


def causal_tile_fraction(T: int) -> float:
    """The fraction of (T, T) score tiles splash computes under a causal mask: nb (nb + 1) / 2 of nb^2."""
    n_blocks = T // (splash_block(T) or T)
    return (n_blocks + 1) / (2 * n_blocks)


def _specs() -> tuple[PartitionSpec, PartitionSpec]:
    """(B, H, T, D) and (B, T) partition specs from the logical axis rules in force (flax's context)."""
    return (nn.logical_to_mesh_axes(("batch", "heads", "length", "head_dim")),
            nn.logical_to_mesh_axes(("batch", "length")))


def _ways(entry: str | tuple[str, ...] | None, mesh_shape: dict[str, int]) -> int:
    names = (entry,) if isinstance(entry, str) else (entry or ())
    return math.prod(mesh_shape[n] for n in names)


def splash_fits(B: int, H: int, T: int) -> bool:
    """Whether splash applies: T tiles, and the rows and heads split evenly over the mesh (if any).

    Other shapes (a model's one-row init, odd lengths) take the XLA path, which gives the same result.
    """
    if splash_block(T) is None:
        return False
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return True
    spec, _ = _specs()
    shape = dict(mesh.shape)
    return B % _ways(spec[0], shape) == 0 and H % _ways(spec[1], shape) == 0


def plain_causal(visible_BTS: Array, B: int) -> bool:
    """Whether a causal visibility mask is the plain causal triangle: one mask row for a batch of several is (the
    model builds its (1, T, S) mask only when no row has padding or packed documents). One row of a batch of one
    may hold either, so it is read as it is."""
    return visible_BTS.shape[0] < B


def padding_segments(visible_BTS: Array, B: int) -> Array | None:
    """Splash segment ids from a causal visibility mask of a batch of B rows: 0 for real keys, a unique id per
    padding key.

    The plain causal mask (`plain_causal`): None. Otherwise the last query sees every earlier real key, so its
    row lists which keys are real. Real queries then see exactly the real keys of the einsum path; a padding
    query sees only itself (the einsum path lets it see the real keys too), so outputs at padding positions
    differ, and nothing reads those.
    """
    if plain_causal(visible_BTS, B):
        return None
    T = visible_BTS.shape[-1]
    return jnp.where(visible_BTS[:, -1, :], 0, 1 + jnp.arange(T)).astype(jnp.int32)


def _splash_local(q_BHTD: Array, k_BHTD: Array, v_BHTD: Array, segments_BT: Array | None,
                  interpret: bool) -> Array:
    """Causal splash attention of the rows and heads one device holds (queries already scaled)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    _, H, T, _ = q_BHTD.shape
    b = splash_block(T)
    sizes = sa.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                          block_kv_dkv_compute=b, use_fused_bwd_kernel=True)
    mask = sa.MultiHeadMask([sa.CausalMask((T, T)) for _ in range(H)])
    kernel = sa.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)
    if segments_BT is None:
        return jax.vmap(kernel)(q_BHTD, k_BHTD, v_BHTD)
    return jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=sa.SegmentIds(s, s)))(
        q_BHTD, k_BHTD, v_BHTD, segments_BT)


def splash_attention(q_BHTD: Array, k_BHTD: Array, v_BHTD: Array, segments_BT: Array | None) -> Array:
    """Causal attention with splash kernels, per device under `jax.shard_map` when a mesh is set.

    Queries must be scaled by 1/sqrt(D) already. Check `splash_fits` first. Returns (B, H, T, D).
    """
    interpret = current_platform() == "cpu"
    mesh = jax.sharding.get_abstract_mesh()
    args = (q_BHTD, k_BHTD, v_BHTD) if segments_BT is None else (q_BHTD, k_BHTD, v_BHTD, segments_BT)

    def local(*a: Array) -> Array:
        return _splash_local(*a[:3], a[3] if len(a) == 4 else None, interpret)

    if mesh.empty:
        return local(*args)
    spec, rows = _specs()
    in_specs = (spec, spec, spec, rows)[:len(args)]
    return jax.shard_map(local, in_specs=in_specs, out_specs=spec, check_vma=False)(*args)


def splash_cost(B: int, H: int, T: int, D: int, itemsize: int, forward_passes: int = 1) -> tuple[float, float]:
    """(FLOPs, HBM bytes) of one layer's splash attention: `forward_passes` forward kernels (2 with remat,
    which reruns the forward pass) and one fused backward kernel. XLA's cost analysis counts ~0 for them.

    FLOPs: the forward kernel does 2 products of 2 B H T^2 D FLOPs (scores, weighted sum), the fused backward
    kernel 5 (scores again, dV, dP, dK, dQ), each over the causal tiles it computes. Bytes: each (B, H, T, D)
    operand or result once, plus the tiles re-read per block row (keys and values in the forward kernel;
    queries, output gradients and the float32 row statistics in the backward one).
    """
    tiles = causal_tile_fraction(T)
    product = 2 * B * H * T * T * D * tiles
    size, stats = B * H * T * D * itemsize, B * H * T * 4
    rereads = tiles * T / (splash_block(T) or T)  # tile rows each operand block is read by: (nb + 1) / 2
    forward_bytes = 2 * size + 2 * size * rereads + stats  # q read, o written, k and v per tile row, logsumexp
    backward_bytes = 5 * size + rereads * (2 * size + 2 * stats)  # k, v, dk, dv, dq once; q, dO, stats per row
    return (2 * forward_passes + 5) * product, forward_passes * forward_bytes + backward_bytes
