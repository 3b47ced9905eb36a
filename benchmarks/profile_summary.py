"""Where a compiled step's time goes on the device, from a `jax.profiler` trace: top ops, kinds, host gaps.

    summary = profile_steps(run_steps, steps=3)   # run_steps(3) runs 3 steps back to back and waits for them

benchmarks/device_check.py calls this after timing the training step, so that a missed speed target comes
with the profile that explains it, read on the host that missed it (no TensorBoard there, and minutes only).
The trace is read with `jax.profiler.ProfileData` (XLA's own reader of its XSpace protobuf). Device work is
every event of the device planes' stream lines (the kernels CUPTI saw on a GPU; a TPU's op lines), or on a
CPU the host events XLA tagged with an `hlo_op`. Each event is named by its HLO op where XLA annotated it,
else by its kernel, and sorted into a kind by its names: attention (cuDNN's fused SDPA kernels and flash
kernels), matmul (cuBLAS, CUTLASS, Triton GEMM fusions, dots) and everything else (elementwise and
reduction fusions: norms, activations, the loss, the optimizer's arithmetic). The host gap is the part of
the steps' wall time in which no device work ran: launches, synchronization, Python between steps; the
longest idle holes are listed with the ops on either side, which says where the device waited.
"""

from __future__ import annotations

import collections
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

KINDS = (("attention", re.compile(r"sdpa|fmha|flash|attention|cudnn", re.I)),
         ("matmul", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|matmul|\bdot|convolution", re.I)))


def kind_of(*names: str) -> str:
    """The first kind any of `names` (an HLO op, a kernel) matches; "other" if none."""
    for kind, pattern in KINDS:
        if any(pattern.search(name) for name in names):
            return kind
    return "other"


def device_events(path: Path) -> list[tuple[str, str, int, int]]:
    """(HLO op or kernel name, kernel name, start ns, duration ns) of every device event of an XSpace file;
    on a CPU backend (no device plane) the host events XLA tagged with an `hlo_op`."""
    from jax.profiler import ProfileData

    device, host = [], []
    for plane in ProfileData.from_file(str(path)).planes:
        on_device = plane.name.startswith("/device:") and "CUSTOM" not in plane.name
        if not on_device and plane.name != "/host:CPU":
            continue
        lines = list(plane.lines)
        if on_device:  # a GPU's stream lines (derived lines, where present, repeat them); a TPU's op lines
            streams = [line for line in lines if line.name.startswith("Stream")]
            lines = streams or [line for line in lines if "Ops" in line.name] or lines
        for line in lines:
            tagged = [(e, dict(e.stats)) for e in line.events]
            tagged = [(e, stats) for e, stats in tagged if on_device or "hlo_op" in stats]
            for e, stats in leaves(tagged):
                op = str(stats.get("hlo_op") or e.name)
                if op.startswith("command_buffer"):  # a CUDA graph's kernels carry the graph's name: use theirs
                    op = e.name
                (device if on_device else host).append((op, e.name, int(e.start_ns), int(e.duration_ns)))
    return device or host


def leaves(events: list[tuple[Any, dict]]) -> list[tuple[Any, dict]]:
    """The (event, stats) of one line whose event contains no other (a CPU's while op spans its body's ops;
    counting both would count that time twice). Events of a line are nested or disjoint, so after sorting by
    start an event is a leaf exactly when the next one starts at or after its end."""
    ordered = sorted(events, key=lambda item: (item[0].start_ns, -item[0].duration_ns))
    return [(e, stats) for i, (e, stats) in enumerate(ordered)
            if i + 1 == len(ordered) or ordered[i + 1][0].start_ns >= e.start_ns + e.duration_ns]


def busy_and_gaps(events: list[tuple[str, str, int, int]]) -> tuple[int, list[dict[str, Any]]]:
    """Length of the union of the events' intervals (concurrent kernels count once), and its holes (the device
    idle between the op that ended last and the one that started next), longest first."""
    total, reach, last, holes = 0, None, "", []
    for op, _, start, duration in sorted(events, key=lambda e: e[2]):
        end = start + duration
        if reach is None or start > reach:
            if reach is not None:
                holes.append((start - reach, last, op))
            total += duration
        else:
            total += max(0, end - reach)
        if reach is None or end > reach:
            reach, last = end, op
    holes.sort(reverse=True)
    return total, [{"ns": ns, "after": a, "before": b} for ns, a, b in holes]


def summarize(events: list[tuple[str, str, int, int]], steps: int, wall_s: float, top: int = 12) -> dict[str, Any]:
    """Per-step device milliseconds by kind and for the `top` ops, and the host-gap fraction of `wall_s`."""
    by_op: dict[str, list] = collections.defaultdict(lambda: [0, ""])
    by_kind: collections.Counter = collections.Counter()
    for op, kernel, _, duration in events:
        kind = kind_of(op, kernel)
        by_op[op][0] += duration
        by_op[op][1] = kind
        by_kind[kind] += duration
    device_ns = sum(by_kind.values())
    busy, holes = busy_and_gaps(events)
    idle_before: collections.Counter = collections.Counter()
    for hole in holes:  # a loop's round trip shows as the same wait before the same op, once per trip
        idle_before[hole["before"]] += hole["ns"]
    per_step = lambda ns: ns / steps / 1e6
    return {
        "steps": steps, "wall_ms_per_step": wall_s / steps * 1e3, "device_busy_ms_per_step": per_step(busy),
        "host_gap_fraction": max(0.0, 1 - busy / 1e9 / wall_s) if wall_s else None,
        "kinds_ms_per_step": {k: per_step(by_kind[k]) for k in ("attention", "matmul", "other")},
        "kinds_fraction": {k: by_kind[k] / device_ns if device_ns else 0.0 for k in ("attention", "matmul", "other")},
        "top_ops": [{"op": op, "kind": kind, "ms_per_step": per_step(ns), "fraction": ns / device_ns}
                    for op, (ns, kind) in sorted(by_op.items(), key=lambda item: -item[1][0])[:top]],
        "longest_gaps": [{"ms": h["ns"] / 1e6, "after": h["after"], "before": h["before"]} for h in holes[:top]],
        "idle_before": [{"op": op, "ms_per_step": per_step(ns)} for op, ns in idle_before.most_common(top)],
    }


def profile_steps(run_steps: Callable[[int], Any], steps: int = 3) -> dict[str, Any]:
    """Trace `run_steps(steps)` (`steps` compiled steps back to back, as training runs them, then a wait for the
    last) and summarize them. Where XLA:GPU would run command buffers (CUDA graphs), it runs them under the
    profiler too only if the program was compiled with `xla_enable_command_buffers_during_profiling`; otherwise
    it launches their kernels one by one while tracing, and the trace shows launch gaps an unprofiled step has
    not."""
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            t = time.perf_counter()
            run_steps(steps)
            wall_s = time.perf_counter() - t
        paths = sorted(Path(tmp).rglob("*.xplane.pb"))
        if not paths:
            raise RuntimeError(f"jax.profiler wrote no .xplane.pb under {tmp}")
        events = device_events(paths[-1])
    if not events:
        raise RuntimeError("the trace holds no device events (is this backend's profiler plugin loaded?)")
    return summarize(events, steps, wall_s)


def describe(summary: dict[str, Any], n: int = 6) -> list[str]:
    """Lines for a log: the kinds' shares, the host gap and the top `n` ops."""
    kinds = ", ".join(f"{k} {summary['kinds_ms_per_step'][k]:.1f} ms ({summary['kinds_fraction'][k]:.0%})"
                      for k in ("attention", "matmul", "other"))
    lines = [f"profile of {summary['steps']} steps: {summary['wall_ms_per_step']:.1f} ms per step, device busy "
             f"{summary['device_busy_ms_per_step']:.1f} ms (host gap {summary['host_gap_fraction']:.1%}); {kinds}"]
    lines += [f"  {op['ms_per_step']:8.2f} ms {op['fraction']:6.1%} {op['kind']:<9} {op['op']}"
              for op in summary["top_ops"][:n]]
    lines += [f"  idle {gap['ms']:7.2f} ms after {gap['after']} before {gap['before']}"
              for gap in summary["longest_gaps"][:n]]
    lines += [f"  idle {wait['ms_per_step']:7.2f} ms per step before {wait['op']}"
              for wait in summary["idle_before"][:n]]
    return lines
