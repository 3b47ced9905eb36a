"""Device mesh and the logical-axis rules that place parameters, optimizer state and batches on it.

The model names every parameter axis ("embed", "heads", "mlp", ...); this table says which
mesh axis each name is split over. Data parallelism splits the batch over `data`; FSDP
(ZeRO-3 style) also splits parameters and optimizer state over `fsdp` and gathers them per
layer; tensor parallelism splits heads and the feed-forward width over `tensor`.
This is `jax.jit` with `NamedSharding`, what `pjit` became; nothing here uses `pmap`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxgpt.errors import UserError

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # the mesh axes a batch's rows are split over

# logical axis name -> mesh axis (or axes, or None for replicated)
LOGICAL_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", BATCH_AXES),
    ("length", None),
    ("act_embed", None),
    ("act_mlp", "tensor"),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("position", None),
    ("heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("classes", None),
    ("norm", None),
    ("layers", None),
)


def resolve_mesh_shape(shape: Sequence[int], n_devices: int) -> tuple[int, ...]:
    """Fill one -1 entry with "the rest of the devices" and check the product."""
    shape = [int(s) for s in shape]
    if len(shape) != len(MESH_AXES):
        raise UserError(f"mesh shape {shape} must have {len(MESH_AXES)} entries for axes {MESH_AXES}")
    if shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
        raise UserError(f"mesh shape {shape}: use positive sizes and at most one -1 ('the rest')")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if n_devices % known:
            raise UserError(f"mesh shape {shape} does not divide {n_devices} devices")
        shape[shape.index(-1)] = n_devices // known
    if math.prod(shape) != n_devices:
        raise UserError(f"mesh shape {shape} uses {math.prod(shape)} devices but {n_devices} are available: "
                        "make the product match or put -1 on one axis")
    return tuple(shape)


def make_mesh(shape: Sequence[int], devices: Sequence[Any] | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh with Auto axes (GSPMD propagation; Explicit axes break nn.Embed).

    On TPUs and GPUs the devices are laid out by `mesh_utils.create_device_mesh`, which follows the
    physical interconnect (the tensor axis on neighbouring chips); a mesh that does not factor over the
    physical axes splits them. `devices` may be a TPU topology's compile-only devices (`jaxgpt.aot`).
    """
    devices = list(devices) if devices is not None else jax.devices()
    resolved = resolve_mesh_shape(shape, len(devices))
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    if devices and devices[0].platform in ("tpu", "gpu"):
        for split in (False, True):
            try:
                grid = mesh_utils.create_device_mesh(resolved, devices, allow_split_physical_axes=split)
                return Mesh(grid, MESH_AXES, axis_types=axis_types)
            except (ValueError, NotImplementedError, AssertionError):
                continue
    return Mesh(np.asarray(devices).reshape(resolved), MESH_AXES, axis_types=axis_types)


def rules_for(model_cfg: Any, mesh: Mesh) -> tuple[tuple[str, Any], ...]:
    """The rules table, except that a vocabulary the tensor axis does not divide (GPT-2's 50257) is replicated."""
    if model_cfg.vocab_size % mesh.shape["tensor"] == 0:
        return LOGICAL_RULES
    return tuple((name, None if name == "vocab" else axes) for name, axes in LOGICAL_RULES)


def logical_to_sharding(specs: Any, mesh: Mesh, rules: Sequence[tuple[str, Any]] = LOGICAL_RULES) -> Any:
    """Pytree of logical PartitionSpecs -> pytree of NamedSharding on `mesh`."""
    return nn.logical_to_mesh_sharding(specs, mesh, rules)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Batches are split over data and fsdp along their first axis."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def check_divisibility(model_cfg: Any, mesh: Mesh, global_batch: int, grad_accum: int = 1) -> None:
    """Fail early, with the fix, when a size does not split over its mesh axis."""
    tensor, fsdp = mesh.shape["tensor"], mesh.shape["fsdp"]
    batch_ways = mesh.shape["data"] * fsdp
    problems = []
    if global_batch % grad_accum == 0 and (global_batch // grad_accum) % batch_ways:
        what = f"batch_size {global_batch}" if grad_accum == 1 else (
            f"micro-batch batch_size/grad_accum = {global_batch // grad_accum}")
        problems.append(f"{what} over data*fsdp={batch_ways}")
    for name in ("n_head", "d_ff"):
        if getattr(model_cfg, name) % tensor:
            problems.append(f"model.{name}={getattr(model_cfg, name)} over tensor={tensor}")
    if model_cfg.n_embd % fsdp:
        problems.append(f"model.n_embd={model_cfg.n_embd} over fsdp={fsdp}")
    if problems:
        raise UserError("sizes do not divide the mesh: " + "; ".join(problems) + ": change the mesh or the sizes")
