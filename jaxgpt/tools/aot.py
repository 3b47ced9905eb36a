"""Will it fit, and how fast could it be? Compile the real sharded train step for a TPU slice or GPUs, on a CPU.

    jaxgpt aot --config configs/gpt2_xl.py --topology v5p:4x4x4 \\
        [--config.mesh.fsdp=-1 --config.mesh.data=1 --config.batch_size=256 --config.model.remat=full ...]
    jaxgpt aot --config configs/gpt2_124m.py --topology h100:1 --config.batch_size=64 --config.grad_accum=1

XLA's TPU compiler (libtpu: `pip install "jax[tpu]"`) or GPU compiler (jax's CUDA plugin: `pip install
"jax[cuda13]"`) runs on this host against a topology's compile-only devices (GPUs: `jaxgpt.tools.gpus`).
The program is the trainer's own (`jaxgpt.train.sharding.build_program`: same mesh, same shardings, same
jitted step with donation), and its inputs are abstract (ShapeDtypeStructs with shardings), so nothing is
allocated. Printed per chip:

* memory: parameters, optimizer state, activations/temporaries and the total, against the chip's HBM;
* FLOPs: XLA's count against the analytic 6N + attention count (`jaxgpt.train.flops`). XLA counts a loop body
  once, so for scanned layers the count is extrapolated from unscanned 1- and 2-layer compiles of the
  same step, the gradient-accumulation loop is multiplied by its length, and FLOPs are counted from
  compiles without "windowed einsum" (matmuls that XLA splits into loops over FSDP shards);
* Pallas kernels (splash attention) are custom calls that XLA's cost analysis counts as nearly nothing:
  their FLOPs and bytes are added analytically (`jaxgpt.ops.splash.splash_cost`), once per call the HLO makes;
  so are cuDNN's fused attention calls on GPUs (`jaxgpt.tools.gpus.cudnn_attention_cost`);
* collectives: all-gather, reduce-scatter and all-reduce bytes read from the compiled HLO (`jaxgpt.tools.hlo`,
  loop bodies times their trip counts) and the time they take over the chip's ICI or NVLink bandwidth (ring
  algorithms, one mesh axis at a time);
* GPUs: what the step asks of the host: while loops and their trip counts, kernels and library calls
  launched per step, host transfers (`jaxgpt.tools.gpus.program_facts`);
* a roofline bound on the step time, max(FLOPs / peak FLOP/s, bytes / HBM bandwidth, collective bytes /
  ICI bandwidth), and the model FLOPs utilization (MFU) it implies. A bound, not a prediction: it assumes
  every collective overlaps with compute and every kernel runs at peak, so real steps are slower.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import time
from typing import Any

import jax

from jaxgpt import storage
from jaxgpt.errors import UserError, one_line
from jaxgpt.ops import splash
from jaxgpt.tasks.lm import LanguageModelling
from jaxgpt.tools import gpus, hlo
from jaxgpt.train import sharding as layout
from jaxgpt.train.chips import TPUS, Chip
from jaxgpt.train.config import TrainConfig
from jaxgpt.train.flops import flops_per_token

GiB = 2**30


CHIPS: dict[str, Chip] = TPUS  # the table the trainer's runtime MFU uses too (jaxgpt.train.chips)
TOPOLOGY_HELP = f"GEN:AxB[xC], e.g. v5e:2x2, v5e:16x16, v4:4x4x4, v5p:4x4x8, v6e:8x8; GPUs: {gpus.TOPOLOGY_HELP}"


def parse_topology(topology: str) -> tuple[Chip, tuple[int, ...]]:
    gpu = gpus.parse_topology(topology)
    if gpu:
        return gpu
    match = re.fullmatch(r"(v4|v5e|v5p|v6e):(\d+(?:x\d+){1,2})", topology.strip())
    if not match:
        raise UserError(f"--topology {topology!r} is not understood: use {TOPOLOGY_HELP}")
    return CHIPS[match.group(1)], tuple(int(d) for d in match.group(2).split("x"))


def topology_devices(topology: str) -> list[Any]:
    """The compile-only devices of a TPU slice (one per chip; v4 and v5p in "megacore" mode) or of GPUs."""
    chip, dims = parse_topology(topology)
    if gpus.is_gpu(chip.name):
        return gpus.topology_devices(topology)
    # Compile-only use needs no exclusive hold on TPU chips: without this, libtpu's /tmp/libtpu_lockfile
    # makes a second process on the machine (another compile, a test) fail to load it.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if importlib.util.find_spec("libtpu") is None:
        raise UserError("the TPU compiler (libtpu) is not installed: pip install 'jax[tpu]' (runs on CPU-only hosts)")
    from jax.experimental import topologies

    kwargs = {"chip_config_name": "megacore"} if chip.name == "v4" else {}
    try:
        devices = list(topologies.get_topology_desc(platform="tpu", topology_name=topology, **kwargs).devices)
    except RuntimeError as e:
        raise UserError(f"libtpu could not describe topology {topology!r}: {one_line(e, 300)} "
                        f"(topologies look like {TOPOLOGY_HELP})") from None
    if len(devices) != math.prod(dims) or devices[0].device_kind != chip.device_kind:
        raise UserError(f"topology {topology!r} gave {len(devices)} devices of kind {devices[0].device_kind!r}; "
                        f"expected {math.prod(dims)} of {chip.device_kind!r}")
    return devices


def _resolved(cfg: TrainConfig) -> TrainConfig:
    """The vocabulary comes from the config, else from the prepared dataset's meta.json (no data is read)."""
    if not cfg.vocab_from_data:
        return cfg
    meta = storage.location(cfg.data.dir, "config.data.dir") / "meta.json"
    with storage.guard(meta, "reading"):
        if not meta.exists():
            raise UserError(f"model.vocab_size is unset and {meta} does not exist: pass --config.model.vocab_size "
                            "(e.g. 50304 for GPT-2's BPE padded for sharding)")
        vocab_size = json.loads(meta.read_text())["vocab_size"]
    return cfg.with_model(cfg.model.replace(vocab_size=vocab_size))


def _bytes_per_chip(tree: Any) -> int:
    """Bytes one chip holds of a pytree of sharded ShapeDtypeStructs (shards are even, so any chip)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _cost(compiled: Any) -> tuple[float, float]:
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):
        cost = cost[0]
    if cost is None:  # compile-only GPUs do not answer: the same analysis over their compiled module
        cost = gpus.xla_cost(compiled)
    return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))


# How XLA:TPU words "does not fit": "... required for HLO temporaries (15.76G) exceeds available HBM (15.75G)"
# or "Used 20.1G of 15.75G hbm".
_OOM = re.compile(r"(?:required for [^(]*\(|Used )([\d.]+)([KMGT]?)")


# XLA:TPU may split a matmul whose operand is being all-gathered (FSDP) into a loop over the shards
# ("windowed einsum", overlapping communication with compute). Cost analysis counts a loop body once, so
# the compiles that only count FLOPs and bytes switch that off; the per-chip arithmetic is the same.
COUNTING_OPTIONS = {"xla_tpu_enable_windowed_einsum_for_all_gather": False,
                    "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False}


def program(cfg: TrainConfig, devices: list[Any]) -> layout.Program:
    """The trainer's language-model program on `devices` (a TPU topology's compile-only ones)."""
    mesh = layout.make_mesh(cfg.mesh.shape, devices)
    return layout.build_program(LanguageModelling(cfg, None), cfg.optim, mesh, cfg.batch_size, cfg.grad_accum)


def _compile(cfg: TrainConfig, devices: list[Any], options: dict[str, Any] | None = None
             ) -> tuple[layout.Program, Any]:
    """Lower and compile the trainer's train step for `devices` with abstract inputs."""
    prog = program(cfg, devices)
    shape = (cfg.grad_accum, cfg.batch_size // cfg.grad_accum, cfg.model.block_size)
    with prog.activate():
        lowered = prog.train_step.lower(prog.abstract_state, prog.abstract_batch({"x": shape, "y": shape}),
                                        prog.abstract_key())
        return prog, lowered.compile(compiler_options=options)


def _loops(compiled: Any) -> int:
    return len(re.findall(r"\bwhile\(", compiled.as_text()))


def _variant(cfg: TrainConfig, **model_changes: Any) -> TrainConfig:
    """`cfg` with model changes, and its loss in one chunk: XLA counts a loop body once, and one chunk of the
    whole sequence has the FLOPs and bytes of all the chunks together (every logit is made and read once)."""
    one_chunk = cfg.model.block_size if cfg.loss_chunk else 0
    return dataclasses.replace(cfg.with_model(cfg.model.replace(**model_changes)), loss_chunk=one_chunk)


def _counted(cfg: TrainConfig, devices: list[Any]) -> tuple[float, float]:
    """FLOPs and bytes of one compile made for counting (no windowed-einsum loops)."""
    try:
        compiled = _compile(cfg, devices, COUNTING_OPTIONS)[1]
    except Exception as e:  # a libtpu without these options: count the default program
        if "RESOURCE_EXHAUSTED" in str(e):
            raise
        compiled = _compile(cfg, devices)[1]
    return _cost(compiled)


def _all_layers_cost(cfg: TrainConfig, devices: list[Any]) -> tuple[float, float] | None:
    """FLOPs and bytes of a scanned model's step with every layer counted, or None if that cannot compile.

    XLA counts a scanned layer once. Unscanned 1- and 2-layer versions of the same step give the cost of
    the rest (embeddings, head, optimizer) and of one more layer; extrapolate linearly to n_layer.
    """
    try:
        f1, b1 = _counted(_variant(cfg, n_layer=1, scan_layers=False), devices)
        f2, b2 = _counted(_variant(cfg, n_layer=2, scan_layers=False), devices)
    except Exception:  # e.g. the unscanned variant does not fit: report the count as compiled
        return None
    L = cfg.model.n_layer
    return f1 + (L - 1) * (f2 - f1), b1 + (L - 1) * (b2 - b1)


def analyze(cfg: TrainConfig, topology: str, extrapolate_scan: bool = True) -> dict[str, Any]:
    """Compile `cfg`'s train step for `topology`; return the per-chip report as a dict (see `format_report`).

    `extrapolate_scan=False` skips the two extra compiles that correct XLA's FLOP count for scanned layers
    (the count then covers one layer; the note says so).
    """
    chip, _ = parse_topology(topology)  # a bad topology is reported before anything else
    cfg = _resolved(cfg)
    devices = topology_devices(topology)
    report = _setup(cfg, topology, chip, len(devices))
    t0 = time.perf_counter()
    try:
        prog, compiled = _compile(cfg, devices)
    except Exception as e:  # XLA refuses programs that exceed HBM: that is an answer, not a crash
        if "RESOURCE_EXHAUSTED" not in str(e) and "Ran out of memory" not in str(e):
            raise
        used = _OOM.search(str(e))
        scale = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
        report.update(compile_seconds=time.perf_counter() - t0, fits=False,
                      oom_message=one_line(e, 400),
                      total_bytes=float(used.group(1)) * scale[used.group(2)] if used else None)
        return report
    report["compile_seconds"] = time.perf_counter() - t0
    report["n_params"] = sum(math.prod(x.shape) for x in jax.tree.leaves(prog.abstract_state["params"]))
    report.update(_memory(prog, compiled, chip))
    flops, bytes_accessed, notes = _step_cost(cfg, compiled, devices, report, extrapolate_scan)
    report.update(_roofline(cfg, chip, compiled.as_text(), flops, bytes_accessed, report["n_chips"]), notes=notes)
    if gpus.is_gpu(chip.name):
        report["gpu"] = gpus.program_facts(compiled.as_text())
    return report


def _setup(cfg: TrainConfig, topology: str, chip: Any, n_chips: int) -> dict[str, Any]:
    """The report's description of the run: topology, chip, mesh, batch and model."""
    return {
        "topology": topology, "chip": chip.name, "n_chips": n_chips, "hbm_bytes": chip.hbm_bytes,
        "accelerator": f"NVIDIA {chip.name}" if gpus.is_gpu(chip.name) else f"TPU {chip.name}",
        "peak_flops": chip.peak_flops, "hbm_bandwidth": chip.hbm_bandwidth,
        "mesh": dict(zip(layout.MESH_AXES, layout.resolve_mesh_shape(cfg.mesh.shape, n_chips), strict=True)),
        "batch_size": cfg.batch_size, "grad_accum": cfg.grad_accum, "block_size": cfg.model.block_size,
        "loss_chunk": cfg.loss_chunk,
        "model": {k: getattr(cfg.model, k) for k in ("n_layer", "n_head", "n_embd", "vocab_size", "dtype",
                                                     "param_dtype", "remat", "scan_layers", "attention_impl")},
    }


def _memory(prog: Any, compiled: Any, chip: Any) -> dict[str, Any]:
    """Bytes per chip: parameters, optimizer state, other inputs, temporaries, outputs, code; whether they fit."""
    mem = compiled.memory_analysis()
    params_b = _bytes_per_chip(prog.abstract_state["params"])
    opt_b = _bytes_per_chip(prog.abstract_state["opt_state"])
    args_b, out_b, alias_b = mem.argument_size_in_bytes, mem.output_size_in_bytes, mem.alias_size_in_bytes
    total = args_b + out_b - alias_b + mem.temp_size_in_bytes + mem.generated_code_size_in_bytes
    return dict(param_bytes=params_b, opt_bytes=opt_b, other_input_bytes=max(args_b - params_b - opt_b, 0),
                temp_bytes=mem.temp_size_in_bytes, unaliased_output_bytes=out_b - alias_b,
                code_bytes=mem.generated_code_size_in_bytes, total_bytes=total, fits=total <= chip.hbm_bytes)


def _step_cost(cfg: TrainConfig, compiled: Any, devices: list, report: dict[str, Any],
               extrapolate_scan: bool) -> tuple[float, float, list[str]]:
    """XLA's (FLOPs, bytes) per chip of one whole step, corrected for the loops it counts once, and notes saying how."""
    flops, bytes_accessed = _cost(compiled)
    report.update(xla_flops_raw=flops, xla_bytes_raw=bytes_accessed)
    notes = []
    if cfg.model.scan_layers and cfg.model.n_layer > 1:
        counted = _all_layers_cost(cfg, devices) if extrapolate_scan else None
        if counted:
            flops, bytes_accessed = counted
            notes.append(f"scanned layers: XLA counts the loop body once ({report['xla_flops_raw']:.3g} FLOPs as "
                         "compiled); extrapolated from unscanned 1- and 2-layer compiles of the same step")
        else:
            notes.append(f"scanned layers: XLA counts the loop body once, so FLOPs and bytes cover 1 of "
                         f"{cfg.model.n_layer} layers")
    elif _loops(compiled) > int(cfg.grad_accum > 1):  # loops XLA counts once (a GPU's loss has none): count without
        flops, bytes_accessed = _counted(_variant(cfg), devices)
        notes.append(f"loops counted once by XLA ({report['xla_flops_raw']:.3g} FLOPs as compiled: "
                     + ("the chunked loss, " if cfg.loss_chunk else "") + "matmuls split over FSDP shards); "
                     "counted from a compile without them" + (" (the loss in one chunk)" if cfg.loss_chunk else ""))
    if cfg.grad_accum > 1:
        flops, bytes_accessed = flops * cfg.grad_accum, bytes_accessed * cfg.grad_accum
        notes.append(f"gradient accumulation: XLA counts the micro-batch loop once; multiplied by {cfg.grad_accum} "
                     "(which overcounts the small optimizer update)")
    kernel_flops, kernel_bytes, n_kernels = _kernel_cost(cfg, report, compiled.as_text())
    if n_kernels:
        what = "cuDNN attention calls" if gpus.is_gpu(report["chip"]) else "Pallas kernel calls (splash attention)"
        notes.append(f"{n_kernels} {what} per step: {kernel_flops:.3g} FLOPs and "
                     f"{kernel_bytes:.3g} bytes added analytically (XLA counts custom calls as ~0)")
    report.update(kernel_flops=kernel_flops, kernel_bytes=kernel_bytes)
    return flops + kernel_flops, bytes_accessed + kernel_bytes, notes


def _roofline(cfg: TrainConfig, chip: Any, text: str, flops: float, bytes_accessed: float,
              n_chips: int) -> dict[str, Any]:
    """The step time each of compute, memory and collectives would take alone, the bound, and what follows."""
    tokens = cfg.batch_size * cfg.model.block_size
    comms = hlo.collectives(text, n_chips)
    by_source = hlo.bytes_by_source(text)
    moved = sum(by_source.values()) or 1.0
    traffic = sum(c["traffic"] for c in comms.values())
    analytic = flops_per_token(cfg.model) * tokens / n_chips
    times = {"compute": flops / chip.peak_flops, "memory": bytes_accessed / chip.hbm_bandwidth,
             "collectives": traffic / chip.ici_bandwidth}
    bound = max(times, key=times.get)
    step = times[bound]
    return dict(xla_flops=flops, xla_bytes=bytes_accessed, analytic_flops=analytic, flops_ratio=flops / analytic,
                ici_bandwidth=chip.ici_bandwidth, collectives={k: v for k, v in comms.items() if v["count"]},
                collective_traffic=traffic, bytes_by_source={k: v / moved for k, v in by_source.items()},
                t_compute=times["compute"], t_memory=times["memory"], t_collective=times["collectives"],
                bound=bound, step_time=step, tokens_per_sec=tokens / step, mfu=analytic / (step * chip.peak_flops))


def _kernel_cost(cfg: TrainConfig, report: dict[str, Any], text: str) -> tuple[float, float, int]:
    """Analytic (FLOPs, bytes) per chip per step of the program's attention kernels, and how many calls it makes.

    On GPUs, cuDNN's calls, each from its own shapes (`gpus.cudnn_attention_cost`). On TPUs, splash's: zero when
    the compiled program has no Pallas calls (another attention path, or shapes splash does not tile); per
    micro-batch and layer the forward kernel (twice with remat, which reruns the forward pass) and the fused
    backward kernel, on this chip's rows and heads.
    """
    if gpus.is_gpu(report["chip"]):
        return gpus.cudnn_attention_cost(text)
    calls = hlo.custom_calls(text)
    n_calls = sum(c["runs"] for c in calls)
    if not n_calls:
        return 0.0, 0.0, 0
    m, mesh = cfg.model, report["mesh"]
    rows = cfg.batch_size // cfg.grad_accum // (mesh["data"] * mesh["fsdp"])
    itemsize = 2 if m.dtype in ("bfloat16", "float16") else 4
    flops, bytes_ = splash.splash_cost(rows, m.n_head // mesh["tensor"], m.block_size, m.head_dim, itemsize,
                                        forward_passes=1 if m.remat == "none" else 2)
    return flops * m.n_layer * cfg.grad_accum, bytes_ * m.n_layer * cfg.grad_accum, n_calls


def format_report(r: dict[str, Any]) -> str:
    m = r["model"]
    lines = [
        f"topology {r['topology']}: {r['n_chips']} x {r['accelerator']} ({r['hbm_bytes'] / GiB:.0f} GiB HBM, "
        f"{r['peak_flops'] / 1e12:.0f} TFLOP/s bf16, {r['hbm_bandwidth'] / 1e9:.0f} GB/s per chip); "
        f"mesh data={r['mesh']['data']} fsdp={r['mesh']['fsdp']} tensor={r['mesh']['tensor']}",
        f"model {m['n_layer']} layers x {m['n_embd']} wide, {m['n_head']} heads, vocab {m['vocab_size']}"
        + (f" ({r['n_params'] / 1e6:,.1f}M params)" if "n_params" in r else "")
        + f"; compute {m['dtype']}, params {m['param_dtype']}; remat {m['remat']}; scan_layers {m['scan_layers']}; "
        f"attention {m['attention_impl']}; loss chunk {r['loss_chunk'] or 'none'}",
        f"batch {r['batch_size']} x {r['block_size']} tokens per step (grad_accum {r['grad_accum']}); "
        f"compiled in {r['compile_seconds']:.1f} s",
    ]
    if "param_bytes" not in r:
        used = f"needs at least {r['total_bytes'] / GiB:.2f} GiB" if r.get("total_bytes") else "needs more"
        lines += [f"DOES NOT FIT: XLA refused the program: {used} of {r['hbm_bytes'] / GiB:.0f} GiB HBM per chip",
                  f"  XLA: {r['oom_message']}"]
        return "\n".join(lines)
    fits = "fits" if r["fits"] else "DOES NOT FIT"
    unit, scale = ("GiB", GiB) if r["total_bytes"] >= GiB else ("MiB", 2**20)
    size = lambda key: f"{r[key] / scale:9.2f} {unit}"
    kernels = "cuDNN calls" if "gpu" in r else "Pallas kernels"
    lines += [
        "",
        "memory per chip",
        f"  parameters                      {size('param_bytes')}",
        f"  optimizer state                 {size('opt_bytes')}",
        f"  batch, RNG key, layout padding  {size('other_input_bytes')}",
        f"  activations / temporaries       {size('temp_bytes')}",
        f"  outputs not aliased to inputs   {size('unaliased_output_bytes')}",
        f"  generated code                  {size('code_bytes')}",
        f"  total                           {size('total_bytes')}  of {r['hbm_bytes'] / GiB:.0f} GiB HBM: "
        f"{fits} ({r['total_bytes'] / r['hbm_bytes']:.0%})",
        "",
        "per chip per step",
        f"  {f'FLOPs (XLA + {kernels})':<32}{r['xla_flops']:12.4g}",
        f"  analytic FLOPs (6N + attention) {r['analytic_flops']:12.4g}   XLA / analytic = {r['flops_ratio']:.3f}"
        + {"none": "", "full": "  (remat recomputes the forward pass: about 4/3 expected)",
           "save_dots": "  (save_dots recomputes only element-wise work)"}[m["remat"]],
        f"  {f'HBM bytes (XLA + {kernels})':<32}{r['xla_bytes']:12.4g}",
        *[f"  note: {n}" for n in r["notes"]],
        "",
        f"collectives per chip per step (from the compiled HLO; ring traffic over {r['ici_bandwidth'] / 1e9:.0f} GB/s "
        f"of {'NVLink' if 'gpu' in r else 'ICI'} per chip)",
        *[f"  {kind:<20}{c['count']:6.0f} x {c['bytes'] / 2**20:10.1f} MiB moved, {c['traffic'] / 2**20:10.1f} MiB sent"
          for kind, c in r["collectives"].items()],
        f"  total sent          {r['collective_traffic'] / 2**20:10.1f} MiB",
        "",
        *([*gpus.format_lines(r), ""] if "gpu" in r else []),
        *_roofline_lines(r),
    ]
    return "\n".join(lines)


def _roofline_lines(r: dict[str, Any]) -> list[str]:
    lines = [
        "roofline bound (not a prediction: assumes peak FLOP/s, peak HBM bandwidth and collectives that fully "
        "overlap with compute)",
        f"  compute          {r['t_compute'] * 1e3:10.1f} ms",
        f"  memory           {r['t_memory'] * 1e3:10.1f} ms",
        f"  collectives      {r['t_collective'] * 1e3:10.1f} ms",
        f"  step time     >= {r['step_time'] * 1e3:10.1f} ms ({r['bound']}-bound)  -> <= {r['tokens_per_sec']:,.0f} "
        f"tokens/s, roofline-bound MFU <= {r['mfu']:.1%}",
    ]
    if r["bound"] == "memory":
        lines += ["  where the HBM bytes go (shares of the compiled step's top-level ops, by name scope):",
                  *[f"    {source:<40}{share:6.1%}" for source, share in list(r["bytes_by_source"].items())[:6]]]
    return lines
