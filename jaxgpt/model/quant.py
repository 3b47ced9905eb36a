"""QLoRA's frozen base: the blocks' linear kernels held in int8 or 4-bit NF4, dequantized inside the projection.

Two formats, both symmetric absmax scaling of each output channel over a group of input rows:
* "int8": one float32 scale per output channel over all its inputs (per-channel), codes round(127 w / absmax).
* "nf4": QLoRA's NormalFloat code book (16 levels at the quantiles of a normal distribution, scaled to [-1, 1],
  with an exact zero) over groups of `group` inputs (64 by default, as bitsandbytes), two codes packed per byte:
  the first half of the input rows in the low nibble, the second half in the high one.
A kernel (lead..., *in, *out) becomes {"kernel_q": (lead..., K or K / 2, N), "kernel_scale": (lead..., G, N)}
with K, N its flattened input and output sizes and G the groups; the format is told by kernel_q's dtype (int8 or
uint8), the group size by the scale's shape, so the tree describes itself as an adapter tree does.

`EinsumDense` projects with `project` when it finds kernel_q: the dequantized kernel exists only inside that call,
which is rematerialized (`jax.checkpoint`), so the backward pass keeps x and the quantized kernel rather than a float
copy per layer: the base the train step receives (`Program.frozen`) is the quantized one, and so is what it holds.

Why not qwix (on PyPI, installable here): its LoRA/QLoRA mode intercepts a whole model's einsum and dot_general
calls and adds adapter parameters of its own naming and placement, where jaxgpt's adapters are a tree of its own that
PEFT import/export, the stacked serving form and the sharding rules read, and where projections run through
`jaxgpt.ops.projection` (custom-VJP bf16 products on CPUs, output-major storage); using it for the storage alone
would add a dependency for the forty lines below. The quantized kernels are replicated over a mesh's model axes
(their scanned "layers" axis keeps its name).
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxgpt.errors import UserError
from jaxgpt.model import lora
from jaxgpt.ops import projection

Array = jax.Array
# QLoRA's NF4 levels (Dettmers et al. 2023, appendix E): normal quantiles scaled to [-1, 1], 0 exact
NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                0.7229568362236023, 1.0], np.float32)


def quantize(w: np.ndarray, n_lead: int, n_in: int, kind: str, group: int) -> dict[str, np.ndarray]:
    """A kernel (lead..., *in, *out) as {"kernel_q", "kernel_scale"} (the module docstring), on the host."""
    lead = w.shape[:n_lead]
    K = math.prod(w.shape[n_lead:n_lead + n_in])
    G = 1 if kind == "int8" else K // group
    w_GgN = np.asarray(w, np.float32).reshape(*lead, G, K // G, -1)
    absmax = np.abs(w_GgN).max(axis=-2, keepdims=True)
    scale = np.where(absmax == 0, 1.0, absmax).astype(np.float32)
    if kind == "int8":
        q = np.round(w_GgN / scale * 127).astype(np.int8).reshape(*lead, K, -1)
        return {"kernel_q": q, "kernel_scale": (scale / 127).reshape(*lead, G, -1)}
    codes = np.searchsorted((NF4[1:] + NF4[:-1]) / 2, w_GgN / scale).astype(np.uint8).reshape(*lead, K, -1)
    packed = codes[..., :K // 2, :] | (codes[..., K // 2:, :] << 4)
    return {"kernel_q": packed, "kernel_scale": scale.reshape(*lead, G, -1)}


def dequantize(q: Array, scale: Array, shape: tuple[int, ...]) -> Array:
    """The float32 kernel of `shape` (with its leading axes, as q has them) that `quantize` encoded."""
    G, N = scale.shape[-2:]
    lead = q.shape[:-2]
    K = math.prod(shape) // (math.prod(lead) * N)
    w = q.astype(jnp.float32) if q.dtype == jnp.int8 else jnp.asarray(NF4)[jnp.concatenate([q & 15, q >> 4], -2)]
    return (w.reshape(*lead, G, K // G, N) * scale[..., None, :]).reshape(shape)


def project(spec: str, x: Array, q: Array, scale: Array, bias: Array | None, *, kernel_shape: tuple[int, ...],
            dtype: str, out_dtype: str) -> Array:
    """`jaxgpt.ops.projection.project` on the dequantized kernel, rematerialized in the backward pass."""
    def run(x: Array, q: Array, scale: Array, bias: Array | None) -> Array:
        kernel = dequantize(q, scale, kernel_shape)  # under scan: one layer's q, no lead axis
        return projection.project(spec, x, kernel, bias, kernel_shape=kernel_shape, dtype=dtype, out_dtype=out_dtype)
    return jax.checkpoint(run)(x, q, scale, bias)


def quantize_base(params: dict[str, Any], abstract: Any, kind: str, group: int) -> tuple[dict[str, Any], Any]:
    """A copy of `params` with the blocks' linear kernels quantized (the head and embeddings stay float), and the
    logical PartitionSpecs of the new tree (from `abstract`, the model's boxed abstract parameters)."""
    params, axes = jax.tree.map(lambda a: a, params), nn.get_partition_spec(abstract)  # new dicts, same arrays
    for path, leaf in kernel_paths(abstract):
        n_lead, n_in = int(leaf.names[0] == "layers"), lora.input_axes(path[-2])
        K = math.prod(leaf.value.shape[n_lead:n_lead + n_in])
        if kind == "nf4" and K % group:
            raise UserError(f"config.lora.quantize_group={group} does not divide {'/'.join(path[:-1])}'s {K} inputs: "
                            "use a group size that does (e.g. 64 or 32)")
        node, spec_node = _node(params, path[:-1]), _node(axes, path[:-1])
        node.update(quantize(np.asarray(node.pop("kernel")), n_lead, n_in, kind, group))
        del spec_node["kernel"]
        spec_node["kernel_q"] = spec_node["kernel_scale"] = PartitionSpec(*leaf.names[:n_lead], None, None)
    return params, axes


def dequantize_base(params: dict[str, Any], abstract: Any) -> dict[str, Any]:
    """A copy of a `quantize_base` tree with float32 kernels again (merging adapters into it, benchmarks)."""
    params = jax.tree.map(lambda a: a, params)
    for path, leaf in kernel_paths(abstract):
        node = _node(params, path[:-1])
        if "kernel_q" in node:
            node["kernel"] = dequantize(node.pop("kernel_q"), node.pop("kernel_scale"), leaf.value.shape)
    return params


def kernel_paths(abstract: Any) -> list[tuple[tuple[str, ...], nn.Partitioned]]:
    """(path, boxed leaf) of the blocks' linear kernels: what QLoRA quantizes."""
    flat = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=lambda x: isinstance(x, nn.Partitioned))[0]
    out = []
    for key_path, leaf in flat:
        path = tuple(k.key for k in key_path)
        parent = path[-3] if len(path) > 2 else ""
        if path[-1] == "kernel" and (parent, path[-2]) in lora.MODULES and parent:
            out.append((path, leaf))
    return out


def _node(tree: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    for name in path:
        tree = tree[name]
    return tree
