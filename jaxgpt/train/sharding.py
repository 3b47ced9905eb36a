"""Where a run lives on the devices: the mesh, the rules table, state and batch shardings, the jitted program.

The model names every parameter axis ("embed", "heads", "mlp", ...); `LOGICAL_RULES` says which mesh
axis each name is split over. Data parallelism splits the batch over `data`; FSDP (ZeRO-3 style) also
splits parameters and optimizer state over `fsdp` and gathers them per layer; tensor parallelism splits
heads and the feed-forward width over `tensor`. This is `jax.jit` with `NamedSharding`, what `pjit`
became; nothing here uses `pmap`.

`build_program` turns a task (its model, loss and evaluation) into the sharded, jitted train and eval
steps with their abstract state (shapes and shardings, nothing allocated). The loop runs it on real
devices; `jaxgpt.tools.aot` compiles the very same program for a TPU slice it does not have.
`local_rows` / `read_rows` / `global_array` assemble a global batch from each host's own rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxgpt.errors import UserError
from jaxgpt.model.config import ModelConfig, Seq2SeqConfig, decoder_of
from jaxgpt.ops.platform import is_gpu
from jaxgpt.train.optim import make_optimizer
from jaxgpt.train.step import make_train_step

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
    ("kv_heads", "tensor"),  # grouped-query attention's K key/value heads (replicated when tensor does not divide K)
    ("head_dim", None),
    ("mlp", "tensor"),
    ("classes", None),
    ("norm", None),
    ("layers", None),
    ("lora", None),  # a LoRA adapter's rank (`jaxgpt.model.lora`): small, replicated
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
    physical axes splits them. `devices` may be a TPU topology's compile-only devices (`jaxgpt.tools.aot`).
    """
    devices = list(devices) if devices is not None else jax.devices()
    resolved = resolve_mesh_shape(shape, len(devices))
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    if devices and (devices[0].platform == "tpu" or is_gpu(devices[0].platform)):
        for split in (False, True):
            try:
                grid = mesh_utils.create_device_mesh(resolved, devices, allow_split_physical_axes=split)
                return Mesh(grid, MESH_AXES, axis_types=axis_types)
            except (ValueError, NotImplementedError, AssertionError):
                continue
    return Mesh(np.asarray(devices).reshape(resolved), MESH_AXES, axis_types=axis_types)


@contextlib.contextmanager
def activate(mesh: Mesh, rules: Sequence[tuple[str, Any]]) -> Iterator[None]:
    """The mesh and rules that the model's logical activation constraints resolve against.

    `jax.set_mesh`, not `with mesh:` (deprecated, and it silently turns the constraints into no-ops).
    """
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield


@dataclasses.dataclass(frozen=True)
class ModelSizes:
    """What the layout asks of a model: its attention path and the sizes that must split over the mesh."""

    attention_impl: str
    n_head: int
    n_kv_head: int
    d_ff: int
    n_embd: int
    vocab_sizes: tuple[int, ...]  # the rows of every token table: all shard as "vocab"


def model_sizes(cfg: ModelConfig | Seq2SeqConfig) -> ModelSizes:
    """A GPT's sizes, or an encoder-decoder's: both stacks share the width and heads, not the vocabularies."""
    mc = decoder_of(cfg)
    vocabs = (mc.vocab_size, cfg.src_vocab_size) if isinstance(cfg, Seq2SeqConfig) else (mc.vocab_size,)
    return ModelSizes(mc.attention_impl, mc.n_head, mc.n_kv_head, mc.d_ff, mc.n_embd, vocabs)


def rules_for(sizes: ModelSizes, mesh: Mesh) -> tuple[tuple[str, Any], ...]:
    """The rules table, except that a vocabulary the tensor axis does not divide (GPT-2's 50257) is replicated,
    and so are key/value heads it does not divide (multi-query attention's one head): each device then computes
    them all, a small cost next to the query heads it splits."""
    tensor = mesh.shape["tensor"]
    replicate = {name for name, fits in (("vocab", all(v % tensor == 0 for v in sizes.vocab_sizes)),
                                          ("kv_heads", sizes.n_kv_head % tensor == 0)) if not fits}
    return tuple((name, None if name in replicate else axes) for name, axes in LOGICAL_RULES)


def logical_to_sharding(specs: Any, mesh: Mesh, rules: Sequence[tuple[str, Any]] = LOGICAL_RULES) -> Any:
    """Pytree of logical PartitionSpecs -> pytree of NamedSharding on `mesh`."""
    return nn.logical_to_mesh_sharding(specs, mesh, rules)


def batch_sharding(mesh: Mesh, ndim: int = 2, leading: int = 0) -> NamedSharding:
    """Batch rows are split over data and fsdp; `leading` axes before the rows (micro-batches) are not."""
    return NamedSharding(mesh, PartitionSpec(*([None] * leading), BATCH_AXES, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def check_divisibility(sizes: ModelSizes, mesh: Mesh, global_batch: int, grad_accum: int = 1) -> None:
    """Fail early, with the fix, when a size does not split over its mesh axis."""
    tensor, fsdp = mesh.shape["tensor"], mesh.shape["fsdp"]
    batch_ways = mesh.shape["data"] * fsdp
    problems = []
    if global_batch % grad_accum == 0 and (global_batch // grad_accum) % batch_ways:
        what = f"batch_size {global_batch}" if grad_accum == 1 else (
            f"micro-batch batch_size/grad_accum = {global_batch // grad_accum}")
        problems.append(f"{what} over data*fsdp={batch_ways}")
    for name in ("n_head", "d_ff"):
        if getattr(sizes, name) % tensor:
            problems.append(f"model.{name}={getattr(sizes, name)} over tensor={tensor}")
    if sizes.n_embd % fsdp:
        problems.append(f"model.n_embd={sizes.n_embd} over fsdp={fsdp}")
    if problems:
        raise UserError("sizes do not divide the mesh: " + "; ".join(problems) + ": change the mesh or the sizes")


# ----------------------------------------------------------------------------------------------------
# The program


@dataclasses.dataclass(frozen=True)
class Program:
    """Everything that decides how one training step of a task is laid out on a mesh."""

    mesh: Mesh
    rules: tuple[tuple[str, Any], ...]
    tx: optax.GradientTransformation
    param_axes: Any  # every parameter's logical axis names (nn.get_partition_spec): its role, for the optimizer
    state_sh: dict[str, Any]  # {"params", "opt_state", "step"} -> pytrees of NamedSharding
    batch_sh: dict[str, NamedSharding]  # training batches (A micro-batches, b rows, ...): rows over data x fsdp
    eval_sh: dict[str, NamedSharding]  # evaluation batches (b rows, ...)
    abstract_state: dict[str, Any]  # ShapeDtypeStructs carrying state_sh: the shapes of a real state
    train_step: Callable[..., Any]  # jitted (state, batch, key, *frozen) -> (state, metrics); donates state
    eval_step: Callable[..., Any]  # jitted (params, batch, *frozen) -> the task's evaluation outputs
    frozen: tuple[Any, ...] = ()  # placed inputs every step and evaluation takes untrained: a LoRA run's base

    def activate(self) -> contextlib.AbstractContextManager[None]:
        return activate(self.mesh, self.rules)

    def abstract_batch(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, jax.ShapeDtypeStruct]:
        return {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.batch_sh[k]) for k, shape in shapes.items()}

    def abstract_key(self) -> jax.ShapeDtypeStruct:
        key = jax.eval_shape(lambda: jax.random.key(0))
        return jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated(self.mesh))


def abstract_opt_state(tx: optax.GradientTransformation, abstract: Any, param_sh: Any, repl: NamedSharding) -> Any:
    """Optimizer state shapes with shardings: moments follow their parameter, counters are replicated.

    Explicit, because `tx.init` under jit would otherwise put every moment on one device. A partitioned
    optimizer's (Muon's) moments hold optax.MaskedNode where another group owns the parameter: kept as is.
    """
    shapes = jax.eval_shape(tx.init, abstract)
    shardings = optax.tree_map_params(tx, lambda s, sh: s if isinstance(s, optax.MaskedNode) else sh, shapes,
                                      param_sh, transform_non_params=lambda _: repl,
                                      is_leaf=lambda x: isinstance(x, (jax.ShapeDtypeStruct, optax.MaskedNode)))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def build_program(task: Any, optim: Any, mesh: Mesh, batch_size: int, grad_accum: int = 1) -> Program:
    """The sharded train/eval program of a task (`jaxgpt.train.task.Task`) on `mesh` (real or a TPU topology's)."""
    cfg = model_sizes(task.model_cfg)
    platform = mesh.devices.flat[0].platform
    if cfg.attention_impl == "cudnn" and not is_gpu(platform):
        raise UserError(f"model.attention_impl='cudnn' needs NVIDIA GPUs, but the devices are {platform}: "
                        "use 'xla' (or 'einsum')")
    if cfg.attention_impl == "splash" and is_gpu(platform):
        raise UserError("model.attention_impl='splash' is TPU flash attention (CPUs run it in Pallas interpret mode, "
                        "for tests): on GPUs use 'cudnn' or 'auto'")
    check_divisibility(cfg, mesh, batch_size, grad_accum)
    rules = rules_for(cfg, mesh)
    boxed = jax.eval_shape(task.model.init, jax.random.key(0), *task.example_inputs())["params"]  # nothing allocated
    axes = nn.get_partition_spec(boxed)
    frozen = task.frozen(logical_to_sharding(task.base_axes, mesh, rules)) if hasattr(task, "frozen") else ()
    frozen_sh = tuple(jax.tree.map(lambda a: a.sharding, f) for f in frozen)
    tx = make_optimizer(optim, d_model=cfg.n_embd, axes=axes)
    param_sh = logical_to_sharding(axes, mesh, rules)
    repl = replicated(mesh)
    params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), nn.unbox(boxed), param_sh)
    opt_state = abstract_opt_state(tx, params, param_sh, repl)
    state_sh = {"params": param_sh, "opt_state": jax.tree.map(lambda s: s.sharding, opt_state), "step": repl}
    abstract_state = {"params": params, "opt_state": opt_state, "step": jax.ShapeDtypeStruct((), jnp.int32,
                                                                                              sharding=repl)}
    batch_sh = {k: batch_sharding(mesh, n, leading=1) for k, n in task.batch_ndims.items()}
    eval_sh = {k: batch_sharding(mesh, n) for k, n in task.batch_ndims.items()}
    train_step = jax.jit(make_train_step(task.loss, tx), in_shardings=(state_sh, batch_sh, repl, *frozen_sh),
                         out_shardings=(state_sh, repl), donate_argnums=(0,))
    eval_step = jax.jit(task.evaluate, in_shardings=(param_sh, eval_sh, *frozen_sh), out_shardings=repl)
    return Program(mesh=mesh, rules=rules, tx=tx, param_axes=axes, state_sh=state_sh, batch_sh=batch_sh,
                   eval_sh=eval_sh, abstract_state=abstract_state, train_step=train_step, eval_step=eval_step,
                   frozen=frozen)


# ----------------------------------------------------------------------------------------------------
# Host batch assembly: each process reads only the rows its devices hold


def local_rows(sharding_: jax.sharding.Sharding, global_shape: tuple[int, ...], dim: int,
               process_index: int | None = None) -> list[tuple[int, int]]:
    """The [start, stop) ranges along `dim` that this process's devices hold, merged and sorted.

    This is the layout `jax.make_array_from_process_local_data` expects: the process passes exactly
    these rows, concatenated in order. One range per process when the batch axis is split over
    hosts; the whole axis when it is replicated over them (e.g. tensor parallelism across hosts).
    """
    process_index = jax.process_index() if process_index is None else process_index
    spans = set()
    for device, index in sharding_.devices_indices_map(tuple(global_shape)).items():
        if device.process_index == process_index:
            start, stop, _ = index[dim].indices(global_shape[dim])
            spans.add((start, stop))
    merged: list[tuple[int, int]] = []
    for start, stop in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((start, stop))
    return merged


def read_rows(read: Callable[[int, int], Any], spans: list[tuple[int, int]], n_rows: int, unit: int = 1) -> Any:
    """Read the rows in `spans` (in units of `unit` rows) with `read(process_index, process_count)`.

    `read` returns a pytree of arrays whose first axis is the batch's rows. A single span that is the
    k-th of n equal blocks is read as "process k of n", so only those rows are touched; any other layout
    reads the global batch once and keeps the spans' rows.
    """
    rows = [(a * unit, b * unit) for a, b in spans]
    if len(rows) == 1:
        (start, stop), = rows
        size = stop - start
        if n_rows % size == 0 and start % size == 0:
            return read(start // size, n_rows // size)
    return jax.tree.map(lambda a: np.concatenate([a[s:e] for s, e in rows]), read(0, 1))


def global_array(sharding_: jax.sharding.Sharding, local: np.ndarray, global_shape: tuple[int, ...]) -> jax.Array:
    """Assemble a global array from this process's rows (no host reads another's data)."""
    return jax.make_array_from_process_local_data(sharding_, local, tuple(global_shape))
