"""How training spreads over devices and hosts.

* `build_program`: the sharded train and eval steps for a mesh: parameter, optimizer-state and batch
  shardings, abstract state (shapes + shardings, nothing allocated) and the `jax.jit`-ed steps with
  in/out shardings and donation. The trainer runs it on real devices; `jaxgpt.aot` compiles the very
  same program for a TPU slice it does not have.
* `initialize`: `jax.distributed` from the config (or auto-detected on TPU VMs, SLURM, Open MPI).
* `local_rows` / `global_array`: each process reads only the rows of a batch its devices hold.

Vocabulary: what used to be `pjit` is `jax.jit` with `NamedSharding`s on a `Mesh`; `pmap` (one program
per device, explicit collectives) is not used. See docs/scaling.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxgpt import sharding
from jaxgpt.checkpoint import abstract_params
from jaxgpt.errors import UserError
from jaxgpt.model import GPT, param_partition_specs
from jaxgpt.optim import make_optimizer
from jaxgpt.train_step import make_eval_step, make_train_step


def initialize(d: Any) -> None:
    """`jax.distributed.initialize` from `config.distributed`, with short, configurable timeouts.

    With an empty coordinator address JAX detects the cluster itself (TPU VM slices, SLURM, Open MPI)
    or reads JAX_COORDINATOR_ADDRESS; num_processes / process_id left unset are detected the same way.
    Must run before any computation. A peer that dies later makes the others abort (non-zero exit)
    after `heartbeat_timeout` seconds instead of hanging in a collective.
    """
    if not d.enabled:
        return
    kwargs: dict[str, Any] = dict(initialization_timeout=int(d.initialization_timeout),
                                  heartbeat_timeout_seconds=int(d.heartbeat_timeout))
    if d.coordinator_address:
        kwargs["coordinator_address"] = d.coordinator_address
    if d.num_processes is not None:
        kwargs["num_processes"] = d.num_processes
    if d.process_id is not None:
        kwargs["process_id"] = d.process_id
    try:
        jax.distributed.initialize(**kwargs)
    except (ValueError, TypeError) as e:  # nothing to auto-detect, or inconsistent ids
        raise UserError(f"jax.distributed.initialize failed ({e}): set config.distributed.coordinator_address, "
                        "num_processes and process_id, or launch on a TPU VM / under SLURM") from None


@dataclasses.dataclass(frozen=True)
class Program:
    """Everything that decides how one training step is laid out on a mesh."""

    mesh: Mesh
    rules: tuple[tuple[str, Any], ...]
    model: GPT
    tx: optax.GradientTransformation
    state_sh: dict[str, Any]  # {"params", "opt_state", "step"} -> pytrees of NamedSharding
    batch_sh: NamedSharding  # training batches (A micro-batches, b rows, T): rows over data x fsdp
    eval_sh: NamedSharding  # evaluation batches (b, T)
    abstract_state: dict[str, Any]  # ShapeDtypeStructs carrying state_sh: the shapes of a real state
    train_step: Callable[..., Any]  # jitted (state, batch, key) -> (state, metrics); donates state
    eval_step: Callable[..., Any]  # jitted (params, batch) -> loss

    @contextlib.contextmanager
    def activate(self) -> Iterator[None]:
        """The mesh and rules that the model's logical activation constraints resolve against.

        `jax.set_mesh`, not `with mesh:` (deprecated, and it silently turns the constraints into no-ops).
        """
        with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
            yield

    def abstract_batch(self, batch_size: int, grad_accum: int, block_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        shape = (grad_accum, batch_size // grad_accum, block_size)
        return {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.batch_sh) for k in ("x", "y")}

    def abstract_key(self) -> jax.ShapeDtypeStruct:
        key = jax.eval_shape(lambda: jax.random.key(0))
        return jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=sharding.replicated(self.mesh))


def abstract_opt_state(tx: optax.GradientTransformation, abstract: Any, param_sh: Any, repl: NamedSharding) -> Any:
    """Optimizer state shapes with shardings: moments follow their parameter, counters are replicated.

    Explicit, because `tx.init` under jit would otherwise put every moment on one device.
    """
    shapes = jax.eval_shape(tx.init, abstract)
    shardings = optax.tree_map_params(tx, lambda _, s: s, shapes, param_sh, transform_non_params=lambda _: repl,
                                      is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def state_layout(model: nn.Module, model_cfg: Any, tx: optax.GradientTransformation, mesh: Mesh,
                 rules: Any) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """Where training state lives on `mesh`: (parameter shardings, state shardings, abstract state).

    Parameters follow their logical axis names, optimizer moments their parameter, the step is
    replicated; the abstract state carries those shardings (restore and AOT targets).
    """
    param_sh = sharding.logical_to_sharding(param_partition_specs(model_cfg, model), mesh, rules)
    repl = sharding.replicated(mesh)
    params = abstract_params(model, model_cfg, param_sh)
    opt_state = abstract_opt_state(tx, params, param_sh, repl)
    state_sh = {"params": param_sh, "opt_state": jax.tree.map(lambda s: s.sharding, opt_state), "step": repl}
    abstract_state = {"params": params, "opt_state": opt_state,
                      "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=repl)}
    return param_sh, state_sh, abstract_state


def build_program(cfg: Any, mesh: Mesh) -> Program:
    """The sharded train/eval program of a TrainConfig on `mesh` (real devices or a TPU topology's)."""
    platform = mesh.devices.flat[0].platform
    if cfg.model.attention_impl == "cudnn" and platform != "gpu":
        raise UserError(f"model.attention_impl='cudnn' needs NVIDIA GPUs, but the devices are {platform}: "
                        "use 'xla' (or 'einsum')")
    sharding.check_divisibility(cfg.model, mesh, cfg.batch_size, cfg.grad_accum)
    model, tx = GPT(cfg.model), make_optimizer(cfg.optim)
    rules = sharding.rules_for(cfg.model, mesh)
    param_sh, state_sh, abstract_state = state_layout(model, cfg.model, tx, mesh, rules)
    repl = state_sh["step"]
    batch_sh = NamedSharding(mesh, PartitionSpec(None, sharding.BATCH_AXES, None))
    eval_sh = sharding.batch_sharding(mesh)
    train_step = jax.jit(make_train_step(model, tx), in_shardings=(state_sh, batch_sh, repl),
                         out_shardings=(state_sh, repl), donate_argnums=(0,))
    eval_step = jax.jit(make_eval_step(model), in_shardings=(param_sh, eval_sh), out_shardings=repl)
    return Program(mesh=mesh, rules=rules, model=model, tx=tx, state_sh=state_sh, batch_sh=batch_sh,
                   eval_sh=eval_sh, abstract_state=abstract_state, train_step=train_step, eval_step=eval_step)


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

    `read` returns a pytree of arrays whose first axis is the batch's rows (e.g. `batch_for_step`).
    A single span that is the k-th of n equal blocks is read as "process k of n", so only those rows are
    touched; any other layout reads the global batch once and keeps the spans' rows.
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
