"""What a compiled program's HLO text says that XLA's cost analysis does not: collectives, custom calls, and
(for GPUs) loops, kernel launches and host transfers.

`compiled.cost_analysis()` counts neither the bytes that cross chips nor the work inside custom calls
(Pallas kernels such as splash attention), and counts a loop body once. This module reads the compiled
HLO text instead: every computation gets the number of times one step runs it (the trip counts of the
while loops around it: XLA's `known_trip_count` where it prints one, else the bound of the loop
condition's `i < N`, as jax lowers `lax.scan`), and every collective and custom call is weighted by that
number. XLA:TPU splits an asynchronous collective over several computations (start, overlapped compute,
done) that repeat the op with the same channel id; each channel counts once.

Per-chip traffic of a collective over a group of N chips, for the ring algorithms XLA uses on an ICI
torus: all-gather sends (N - 1) / N of its output, reduce-scatter (N - 1) times its output shard,
all-reduce twice (N - 1) / N of its operand (a reduce-scatter then an all-gather), all-to-all (N - 1) / N,
a collective permute its whole operand.

On a GPU every top-level op of the executed computations that does work is one launch (a fusion is one kernel,
a custom call one library call: cuBLAS, cuDNN), and a `while` launches its body's kernels from the host on every
trip: `launches`, `loops` and `host_transfers` say what a step asks of the host.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from typing import Any

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_OPS = "|".join([*(f"{c}-start" for c in COLLECTIVES), *COLLECTIVES, "custom-call", "while"])
_INSTR = re.compile(r"^\s+(?:ROOT )?%?[\w.\-]+ = (.*?) (" + _OPS + r")\((.*)$")
_CALLEES = re.compile(r"\b(?:body|condition|calls|to_apply|branch_computations|called_computations)="
                      r"(\{[^}]*\}|%?[\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_WHILE = re.compile(r"condition=%?([\w.\-]+), body=%?([\w.\-]+)")
_CHANNEL = re.compile(r"channel_id=(\d+)")


def array_bytes(type_text: str) -> int:
    """Bytes of every array in an HLO type (a tuple's elements summed)."""
    return sum(_BYTES[dt] * math.prod(int(d) for d in dims.split(",") if d) for dt, dims in _ARRAY.findall(type_text))


def _computations(hlo: str) -> list[tuple[str, list[str]]]:
    """(name, instruction lines) of every computation, in the text's order (callees before callers)."""
    comps: list[tuple[str, list[str]]] = []
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header:
            comps.append((header.group(1), []))
        elif comps and line.startswith("  "):
            comps[-1][1].append(line)
    return comps


def _condition_bound(lines: list[str]) -> int | None:
    """N of a loop condition that is one `counter < N` against an integer constant (jax's scan loops)."""
    constants = re.findall(r"s32\[\]\{?[^ ]* constant\((\d+)\)", "\n".join(lines))
    compares = [line for line in lines if "compare(" in line]
    if len(constants) == 1 and len(compares) == 1 and "direction=LT" in compares[0]:
        return int(constants[0])
    return None


def run_counts(hlo: str) -> dict[str, int]:
    """How many times one execution runs each computation (while bodies times their trip counts).

    A loop whose trip count cannot be read counts once (XLA's cost analysis does the same).
    """
    comps = _computations(hlo)
    bodies = dict(comps)
    counts: dict[str, int] = defaultdict(int)
    if comps:
        counts[comps[-1][0]] = 1  # ENTRY comes last
    for name, lines in reversed(comps):
        for line in lines:
            trip, loop = _TRIP.search(line), _WHILE.search(line)
            n = int(trip.group(1)) if trip else (_condition_bound(bodies.get(loop.group(1), [])) if loop else None)
            for match in _CALLEES.finditer(line):
                loop_body = loop is not None and match.group(0).startswith("body=")
                for callee in re.findall(r"[\w.\-]+", match.group(1)):
                    counts[callee] += counts[name] * ((n or 1) if loop_body else 1)
    return dict(counts)


def _group_size(line: str, n_devices: int) -> int:
    """Participants per replica group: the mesh form (mesh['axis_0'=2,...] ... {'axis_0'}: the listed axes),
    {{0,1,2,3},...}, the iota form [G,N]<=[...], or all devices."""
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", line)
    if mesh:
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", mesh.group(1))}
        return math.prod(sizes.get(axis, 1) for axis in re.findall(r"'([^']+)'", mesh.group(2)))
    iota = re.search(r"replica_groups=\[(\d+(?:,\d+)*)\]<=", line)
    if iota:
        dims = [int(d) for d in iota.group(1).split(",")]
        return math.prod(dims[1:]) if len(dims) > 1 else dims[0]
    listed = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if listed and listed.group(1):
        return len(listed.group(1).split(","))
    return n_devices


def collectives(hlo: str, n_devices: int) -> dict[str, dict[str, float]]:
    """Per collective kind: {"count", "bytes" (the data it moves: all-gather output, reduce-scatter input,
    all-reduce operand), "traffic" (bytes one chip sends, ring algorithms)} of one execution."""
    runs = run_counts(hlo)
    out: dict[str, dict[str, float]] = {k: {"count": 0, "bytes": 0.0, "traffic": 0.0} for k in COLLECTIVES}
    found: dict[str, tuple[int, str, str, str]] = {}  # channel (or a unique key) -> (runs, op, type, line)
    for name, lines in _computations(hlo):
        for i, line in enumerate(lines):
            instr = _INSTR.match(line)
            if not instr or instr.group(2) in ("custom-call", "while") or runs.get(name, 0) == 0:
                continue
            op = instr.group(2)
            if name.startswith("all-reduce-scatter") and op == "all-reduce":  # XLA:TPU's fused reduce-scatter
                op = "reduce-scatter-input"
            channel = _CHANNEL.search(line)
            key = f"channel {channel.group(1)}" if channel else f"{name}:{i}"
            if key not in found or runs[name] > found[key][0]:
                found[key] = (runs[name], op, instr.group(1), line)
    for runs_here, op, type_text, line in found.values():
        n = max(_group_size(line, n_devices), 1)
        size = array_bytes(type_text)
        if op == "reduce-scatter-input":  # an all-reduce whose result each chip slices: its input is scattered
            kind, data, traffic = "reduce-scatter", size, size * (n - 1) / n
        else:
            kind, started = op.removesuffix("-start"), op.endswith("-start")
            if started and kind == "all-gather":  # (operands, outputs): outputs are N times the operands
                size = size * n / (n + 1)
            elif started and type_text.startswith("(("):  # XLA:GPU's ((operands), outputs)
                size = size / 2 if kind == "all-reduce" else size / (n + 1) if kind == "reduce-scatter" else size
            elif started and kind == "collective-permute":  # (operand, output, contexts)
                size = size / 2
            data, traffic = {
                "all-gather": (size, size * (n - 1) / n),
                "reduce-scatter": (size * n, size * (n - 1)),
                "all-reduce": (size, 2 * size * (n - 1) / n),
                "all-to-all": (size, size * (n - 1) / n),
                "collective-permute": (size, size),
            }[kind]
        out[kind]["count"] += runs_here
        out[kind]["bytes"] += data * runs_here
        out[kind]["traffic"] += traffic * runs_here
    return out


def custom_calls(hlo: str, target: str = "tpu_custom_call") -> list[dict[str, Any]]:
    """The custom calls to targets starting with `target` (Pallas kernels on TPU, "__cudnn$fmha" on GPUs), each
    with its name, target, runs per execution, result type and bytes, and backend config (JSON text)."""
    runs = run_counts(hlo)
    found = []
    for name, lines in _computations(hlo):
        for line in lines:
            instr = _INSTR.match(line)
            called = re.search(r'custom_call_target="([^"]*)"', line)
            if instr and instr.group(2) == "custom-call" and called and called.group(1).startswith(target):
                kernel = re.match(r"\s+(?:ROOT )?%?([\w\-]+?)(?:\.\d+)? = ", line)  # Pallas names the op after it
                config = re.search(r"backend_config=(.*)$", line)
                found.append({"kernel": kernel.group(1) if kernel else "", "target": called.group(1),
                              "runs": runs.get(name, 0), "result_type": instr.group(1),
                              "result_bytes": array_bytes(instr.group(1)), "config": config.group(1) if config else ""})
    return found


_ANY = re.compile(r"^\s+(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")
_NO_TRAFFIC = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "while", "after-all",
               "partition-id", "replica-id", "iota", "conditional", "call", "async-start", "async-done"}


def _source(op_name: str) -> str:
    """Which part of a GPT training step an op comes from, by the jax/flax name scope XLA keeps in metadata."""
    if "splash" in op_name:
        return "splash attention kernels"
    if "GPT.logits" in op_name or "jvp())/while" in op_name or "jvp()/while" in op_name:
        return "loss: output head and cross-entropy"
    layer = re.search(r"/(attn|mlp)/(?:attn\._out/)?(qkv|out|fc|proj)?", op_name)
    if layer:
        return f"{layer.group(1)}/{layer.group(2)}" if layer.group(2) else f"{layer.group(1)} (element-wise)"
    if re.search(r"/ln_\w+/", op_name):
        return "layer norms"
    if "GPT._embed" in op_name:
        return "embeddings"
    if not op_name:
        return "copies, slices, concatenations XLA adds"
    return "optimizer and gradient sums" if "GPT" not in op_name else "other model ops"


def bytes_by_source(hlo: str) -> dict[str, float]:
    """HBM bytes per step by where the ops come from (`_source`), largest first.

    Every top-level op of the executed computations (the entry and loop bodies, times their runs; a fusion
    is one op) reads its operands and writes its result once: the model XLA's cost analysis also uses, so
    the shares explain its "bytes accessed" total even where the sums differ a little.
    """
    comps = _computations(hlo)
    sizes: dict[str, int] = {}
    for _, lines in comps:
        for line in lines:
            instr = _ANY.match(line)
            if instr:
                sizes[instr.group(1)] = array_bytes(instr.group(2))
    runs, executed = run_counts(hlo), _top_level(comps)
    totals: dict[str, float] = defaultdict(float)
    for name, lines in comps:
        if name not in executed:
            continue
        for line in lines:
            instr = _ANY.match(line)
            if not instr or instr.group(3) in _NO_TRAFFIC or instr.group(3).endswith("-done"):
                continue
            operands = re.findall(r"%([\w.\-]+)", instr.group(4).split("), ")[0])
            moved = sizes.get(instr.group(1), 0) + sum(sizes.get(o, 0) for o in operands)
            if instr.group(3).endswith("-start"):  # its tuple type holds the operands and the result already
                moved = sizes.get(instr.group(1), 0)
                if instr.group(3) == "slice-start":  # (source, slice, context): the slice is read and written
                    moved = 2 * (moved - sum(sizes.get(o, 0) for o in operands))
            op_name = re.search(r'op_name="([^"]*)"', line)
            totals[_source(op_name.group(1) if op_name else "")] += moved * runs.get(name, 0)
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def _top_level(comps: list[tuple[str, list[str]]]) -> set[str]:
    """The computations whose ops run one by one: the entry and the loops' conditions and bodies (not fusions'
    or reducers' bodies, which run inside one kernel)."""
    executed = {comps[-1][0]} if comps else set()
    for _, lines in reversed(comps):
        for line in lines:
            loop = _WHILE.search(line)
            if loop:
                executed.update(loop.groups())
    return executed


def _trip_count(line: str, bodies: dict[str, list[str]]) -> tuple[int | None, bool]:
    """(trips, whether XLA knows them) of a while instruction: its known_trip_count, else its condition's bound."""
    trip = _TRIP.search(line)
    if trip:
        return int(trip.group(1)), True
    loop = _WHILE.search(line)
    return (_condition_bound(bodies.get(loop.group(1), [])) if loop else None), False


_LIBRARIES = (("cuDNN", "__cudnn$"), ("cuBLAS", "__cublas$"), ("host callback", "callback"))


def launch_kind(op: str, line: str) -> str | None:
    """What an executed top-level op launches on a GPU: "matmul" (a GEMM fusion: Triton or, once the GPU's
    autotuner picks it, cuBLAS), a library ("cuDNN", "cuBLAS", "host callback", "custom call"), "collective",
    "copy", "fusion" (any other fused kernel) or "other" (an unfused op); None for ops that launch nothing."""
    if op in _NO_TRAFFIC or op.endswith("-done"):
        return None
    if op == "custom-call":
        target = re.search(r'custom_call_target="([^"]*)"', line)
        return next((name for name, key in _LIBRARIES if target and key in target.group(1)), "custom call")
    if op.removesuffix("-start") in COLLECTIVES:
        return "collective"
    if op in ("copy", "copy-start"):
        return "copy"
    if op in ("fusion", "fusion-start"):
        if '"kind":"__triton_collective"' in line:  # XLA:GPU's one-kernel all-reduce of small operands
            return "collective"
        return "matmul" if re.search(r'"kind":"__(?:triton_gemm|triton_nested_gemm|cublas)', line) else "fusion"
    return "other"


def launches(hlo: str) -> dict[str, int]:
    """Kernels and library calls one execution launches, by `launch_kind` (loop bodies times their trips)."""
    comps, runs, counts = _computations(hlo), run_counts(hlo), defaultdict(int)
    executed = _top_level(comps)
    for name, lines in comps:
        if name not in executed:
            continue
        for line in lines:
            instr = _ANY.match(line)
            kind = launch_kind(instr.group(3), line) if instr else None
            if kind:
                counts[kind] += runs.get(name, 0)
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def loops(hlo: str) -> list[dict[str, Any]]:
    """Every while loop one execution runs: its op name (jax's name scope), trips (None: unknown to XLA and not
    read from its condition), whether XLA knows them, and the launches of one trip of its body."""
    comps = _computations(hlo)
    bodies, executed, found = dict(comps), _top_level(comps), []
    for name, lines in comps:
        for line in lines if name in executed else ():
            instr, loop = _ANY.match(line), _WHILE.search(line)
            if not (instr and loop and instr.group(3) == "while"):
                continue
            trips, known = _trip_count(line, bodies)
            body = bodies.get(loop.group(2), [])
            per_trip = sum(1 for b in body if (m := _ANY.match(b)) and launch_kind(m.group(3), b))
            op_name = re.search(r'op_name="([^"]*)"', line)
            found.append({"op": op_name.group(1) if op_name else instr.group(1), "trips": trips, "known": known,
                          "body_launches": per_trip})
    return found


def host_transfers(hlo: str) -> list[dict[str, Any]]:
    """What one execution moves between host and device: host sends and receives, infeed and outfeed, values in
    host memory (memory space S(5)), host callbacks, and the condition of a loop whose trip count XLA does not
    know (read back on every trip). Each with its op, kind, bytes and runs per execution."""
    comps, runs, found = _computations(hlo), run_counts(hlo), []
    bodies, executed = dict(comps), _top_level(comps)
    for name, lines in comps:
        for line in lines if name in executed else ():
            instr = _ANY.match(line)
            if not instr:
                continue
            op, kind = instr.group(3), None
            if op in ("send", "recv") and "is_host_transfer=true" in line:
                kind = f"host {op}"
            elif op in ("infeed", "outfeed"):
                kind = op
            elif ":S(5)" in instr.group(2) and op not in _NO_TRAFFIC:
                kind = "to host memory"
            elif launch_kind(op, line) == "host callback":
                kind = "host callback"
            elif op == "while" and not _trip_count(line, bodies)[1]:
                kind = "loop condition read by the host"
            if kind:
                found.append({"op": instr.group(1), "kind": kind, "bytes": array_bytes(instr.group(2)),
                              "runs": runs.get(name, 0)})
    return found
