"""Compiling for NVIDIA GPUs that this host does not have: compile-only CUDA devices, and what the GPU program asks
of the host.

jax's CUDA plugin (`pip install "jax[cuda13]"`) installs on CPU-only hosts, and
`jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=..., topology="1x1xN")` gives N
compile-only GPUs of one node from a GpuTargetConfig (a text proto: the device description XLA's GPU compiler
reads from a real device: SMs, memory, clocks, compute capability, library versions). Those of the H100 and
H200 are in `gpu_targets/` beside this file. XLA cannot autotune without the device, so where a real GPU picks
cuBLAS for a product the program compiled here keeps a Triton GEMM: the same kernel count, other kernels.

On a GPU the step's speed also depends on what it asks of the host, which the compiled HLO shows
(`jaxgpt.tools.hlo`): every `while` loop launches its body's kernels from the host on every trip (outside the
CUDA graphs XLA makes of the rest unless WHILE is among `--xla_gpu_enable_command_buffer`'s types), a loop
whose trip count XLA does not know also reads its condition back on every trip, and a host transfer or callback
waits for the host. `program_facts` lists them with the kernels launched per step; `format_lines` prints them.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import jax

from jaxgpt.errors import UserError, one_line
from jaxgpt.tools import hlo
from jaxgpt.train.chips import GPUS, Chip

TARGETS = Path(__file__).resolve().parent / "gpu_targets"
CHIPS: dict[str, Chip] = {chip.name.lower(): chip for chip in GPUS if (TARGETS / f"{chip.name.lower()}.txtpb").exists()}
TOPOLOGY_HELP = "h100:N or h200:N, N GPUs of one NVLink node (1 to 8), e.g. h100:1, h200:1, h100:8"
INSTALL = 'pip install "jax[cuda13]" (it compiles for GPUs on CPU-only hosts too)'
CUDNN_ATTENTION = "__cudnn$fmha"  # custom_call_target prefix of cuDNN's fused attention (forward and backward)


def is_gpu(chip_name: str) -> bool:
    """Whether a chip of `jaxgpt.train.chips` is one of the GPUs this module compiles for."""
    return chip_name.lower() in CHIPS


def parse_topology(topology: str) -> tuple[Chip, tuple[int]] | None:
    """(chip, (N,)) of a GPU topology such as h100:8; None if `topology` is not one (a TPU slice, or a typo)."""
    match = re.fullmatch(r"([a-z]\d+):(\d+)", topology.strip())
    if not match or match.group(1) not in CHIPS:
        return None
    n = int(match.group(2))
    if not 1 <= n <= 8:
        raise UserError(f"--topology {topology!r}: one node holds 1 to 8 GPUs (use {TOPOLOGY_HELP})")
    return CHIPS[match.group(1)], (n,)


def target_config(chip: Chip) -> str:
    """The GpuTargetConfig text proto XLA compiles `chip`'s programs against."""
    return (TARGETS / f"{chip.name.lower()}.txtpb").read_text()


def has_cuda_plugin() -> bool:
    """Whether jax's CUDA plugin (CUDA 12 or 13) is installed, whether or not this host has a GPU."""
    return importlib.util.find_spec("jax_plugins") is not None and any(
        importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") is not None for v in (12, 13))


def topology_devices(topology: str) -> list[Any]:
    """N compile-only GPUs of one node, one process (jax's CUDA plugin, on any host)."""
    chip, (n,) = parse_topology(topology)
    if not has_cuda_plugin():
        raise UserError(f"the GPU compiler (jax's CUDA plugin) is not installed: {INSTALL}")
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(platform="cuda", target_config=target_config(chip), topology=f"1x1x{n}")
    except Exception as e:  # a plugin that cannot read this target config, or a jax without the option
        raise UserError(f"jax's CUDA plugin could not describe {topology!r}: {one_line(e, 300)} "
                        f"(upgrade it: {INSTALL})") from None
    return list(topo.devices)


def xla_cost(compiled: Any) -> dict[str, float]:
    """XLA's cost analysis of a program compiled for compile-only GPUs, which do not answer `cost_analysis()`:
    the same analysis (FLOPs, bytes accessed) run by the CPU client over the compiled GPU module."""
    from jax._src.lib import _jax  # the analysis jax's own `Lowered.cost_analysis` calls

    module = compiled.runtime_executable().hlo_modules()[0]
    return dict(_jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module))


def cudnn_attention_cost(text: str) -> tuple[float, float, int]:
    """Analytic (FLOPs, HBM bytes, calls) per step of cuDNN's fused attention calls, which XLA's cost analysis
    counts as nothing. Per (B, H, T, D) call: the forward kernel does 2 products of 2 B H T^2 D FLOPs (scores,
    weighted sum), the backward kernel 5 (scores again, dV, dP, dK, dQ), half of each when causal; bytes: every
    (B, H, T, D) operand and result once (forward q, k, v, out; backward q, k, v, out, dout, dq, dk, dv), plus the
    float32 row statistics."""
    flops = bytes_ = 0.0
    calls = hlo.custom_calls(text, CUDNN_ATTENTION)
    for call in calls:
        B, H, T, D = (int(d) for d in re.search(r"\[(\d+),(\d+),(\d+),(\d+)\]", call["result_type"]).groups())
        causal = 0.5 if re.search(r'"mask_type":\s*"CAUSAL', call["config"]) else 1.0
        backward = call["target"].endswith("Backward")
        size, stats = B * H * T * D * 2, B * H * T * 4  # bf16/fp16 operands: cuDNN's fused attention takes no fp32
        flops += call["runs"] * (5 if backward else 2) * 2 * B * H * T * T * D * causal
        bytes_ += call["runs"] * ((8 if backward else 4) * size + stats)
    return flops, bytes_, sum(call["runs"] for call in calls)


def program_facts(text: str) -> dict[str, Any]:
    """What one step of the compiled GPU program asks of the host: its loops, its launches by kind, its host
    transfers (see `jaxgpt.tools.hlo`)."""
    return {"loops": hlo.loops(text), "launches": hlo.launches(text), "host_transfers": hlo.host_transfers(text)}


def format_lines(r: dict[str, Any]) -> list[str]:
    """The report's GPU section: loops, launches per step, host transfers, and what JAX lets a process allocate."""
    facts = r["gpu"]
    launches = facts["launches"]
    kinds = ", ".join(f"{n:,} {kind}" for kind, n in launches.items())
    lines = ["GPU program per step (from the compiled HLO; a loop's body is launched from the host every trip)",
             f"  while loops             {len(facts['loops'])}"]
    lines += [f"    {loop['op']}: {loop['trips'] if loop['trips'] is not None else 'unknown'} trips"
              f"{'' if loop['known'] else ' (not known to XLA: the host reads the condition every trip)'}, "
              f"{loop['body_launches']} launches per trip" for loop in facts["loops"]]
    lines.append(f"  launches                {sum(launches.values()):,} ({kinds}); matmuls are Triton GEMMs here, "
                 "cuBLAS where a GPU's autotuner picks it")
    transfers = facts["host_transfers"]
    lines.append(f"  host <-> device         {'none' if not transfers else ''}")
    lines += [f"    {t['kind']}: {t['op']}, {t['bytes']:,} bytes x {t['runs']}" for t in transfers]
    lines.append("  JAX allocates 75% of a GPU's memory by default (XLA_PYTHON_CLIENT_MEM_FRACTION): "
                 f"{0.75 * r['hbm_bytes'] / 2**30:.0f} GiB of {r['hbm_bytes'] / 2**30:.0f} here")
    return lines
