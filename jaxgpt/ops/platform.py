"""Which backend a traced program is for: the one question every platform-specific path in `jaxgpt.ops` asks; and
the one process setting a CPU backend wants (`keep_freed_memory`)."""

from __future__ import annotations

import ctypes

import jax

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
KEPT_BLOCKS = 1 << 30  # bytes: blocks below this come from (and go back to) the process's heap


def current_platform() -> str:
    """The platform a traced program is for: the mesh's (`jax.set_mesh`, also a TPU topology's abstract
    devices when compiling ahead of time), else the default backend's."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    return device.platform if device is not None else jax.default_backend()


def is_gpu(platform: str) -> bool:
    """Whether `platform` (a device's or `current_platform`) is NVIDIA GPUs: jax names them "gpu", some tools "cuda"."""
    return platform in ("gpu", "cuda")


def on_gpu() -> bool:
    """Whether a traced program is for NVIDIA GPUs (`current_platform`)."""
    return is_gpu(current_platform())


def keep_freed_memory() -> bool:
    """On a CPU backend with glibc, keep freed memory in the process for the next program instead of returning it
    to the system; whether that was done. For a process that runs the same programs over and over: a server.

    XLA:CPU allocates each run's temporaries afresh. glibc maps blocks above its threshold (128 KiB, adapting up
    to 32 MiB) straight from the system and unmaps them when freed, and trims its heap above 128 KiB free, so
    every run of a program page-faults its temporaries in again: in a profile of the serving engine's 16-row
    decode chunk, the copies that write them first were the largest cost, and raising both thresholds made the
    step markedly faster. vLLM's CPU backend asks for tcmalloc for the same reason; mallopt does it without
    preloading another allocator. The process keeps its peak heap.
    """
    if jax.default_backend() != "cpu":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's C library: glibc has mallopt, macOS's and musl's not
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, KEPT_BLOCKS)) and bool(mallopt(M_TRIM_THRESHOLD, KEPT_BLOCKS))
