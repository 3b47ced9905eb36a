"""What a process sets up before its first computation, and the checks on where a run writes.

CPU devices, the persistent compile cache and `jax.distributed` must all be configured before JAX
starts computing: `setup(cfg)` does them in that order. Vocabulary: what used to be `pjit` is
`jax.jit` with `NamedSharding`s on a `Mesh` (`jaxgpt.train.sharding`); `pmap` is not used. See docs/scaling.md.
"""

from __future__ import annotations

import os
from typing import Any

import jax

from jaxgpt import storage
from jaxgpt.errors import UserError
from jaxgpt.train.config import DistributedConfig, TrainConfig


def use_cpu_devices(n: int) -> None:
    """Split this host's CPU into `n` XLA devices, so that the default mesh is data parallel over the cores.

    XLA:CPU runs the ops of one device largely one after another, and the small ones (norms, softmax,
    the attention of a 128-wide model) on a single thread; a second device working on its own half of
    the batch keeps the other core busy. It pays off for small models only (benchmarks/bench_train.py
    times both; the README has the numbers). Only the CPU backend is affected: on GPUs and
    TPUs the mesh is made of those. JAX fixes the device count when it starts computing, hence the check.
    """
    if n < 0:
        raise UserError(f"config.cpu_devices={n} must be >= 0 (0 keeps JAX's default of one CPU device)")
    if n == 0:
        return
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # the CPU backend is already running
        if len(jax.devices("cpu")) != n:
            raise UserError(f"config.cpu_devices={n}, but JAX already runs {len(jax.devices('cpu'))} CPU device(s): "
                            "set it before any JAX computation in this process, or use --config.cpu_devices=0"
                            ) from None


def initialize_distributed(d: DistributedConfig) -> None:
    """`jax.distributed.initialize` from `config.distributed`, with short, configurable timeouts.

    With an empty coordinator address JAX detects the cluster itself (TPU VM slices, SLURM, Open MPI)
    or reads JAX_COORDINATOR_ADDRESS; num_processes / process_id left unset are detected the same way.
    A peer that dies later makes the others abort (non-zero exit) after `heartbeat_timeout` seconds
    instead of hanging in a collective.
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


def setup(cfg: TrainConfig) -> None:
    """CPU devices, persistent compile cache and multi-host initialization: all must precede any computation."""
    use_cpu_devices(cfg.cpu_devices)
    if cfg.compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(cfg.compilation_cache_dir))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    initialize_distributed(cfg.distributed)


def check_workdir(workdir: str) -> storage.Location:
    """The run's directory (local, or a bucket URL), created and probed for writing before any expensive work."""
    path = storage.location(workdir, "--config.workdir")
    storage.check_writable(path, "--config.workdir")
    return path
