"""One command for a GPU or TPU host: the environment, the accelerator test subset and speed against PyTorch.

    python benchmarks/device_check.py                  # on the accelerator host (docs/accelerators.md)
    python benchmarks/device_check.py --smoke --out /tmp/check.json   # every part at tiny shapes on the CPU
    python benchmarks/device_check.py --parts generate,hf_generate --attention xla   # some parts again

An accelerator host is lent for minutes, offline, so everything it should tell is collected by this one run and
written as one JSON file (--out; default benchmarks/results/device_check-<device>-<date>.json) and one table.
Each part runs in a subprocess of its own under its own time limit, inside a budget for the whole run
(--budget): a failure, a hang, an out-of-memory abort or a crash of one part is recorded in its row, with its
one-line error and the tail of its log, and the next part runs. The parent process never imports JAX, so it
holds no device memory and every part has the whole device to itself.

Parts, in the order they run (docs/accelerators.md describes each): env (devices, versions, CUDA/cuDNN or TPU
runtime, memory, missing imports, and on GPUs the target description XLA compiles for: `jaxgpt aot`'s input); train
(GPT-2 124M as configs/gpt2_124m.py trains it, through bench_train's real train step, at the largest per-device
batch that fits, steps back to back as the trainer runs them: tokens/s, MFU; then where the step's time goes
(benchmarks/profile_summary.py: top ops, attention/matmul/other, host gaps; on GPUs with command buffers on while
profiling), the optimizer's update alone); torch_train (the same model in PyTorch: torch.compile, flash SDPA, bf16
autocast); train_medium (GPT-2 medium, 350M, the same way: tokens/s, MFU); generate (cached greedy generation at
batch 1 and 64 against its targets and the HBM bound, its decode loop's XLA options against XLA's settings and each
left out, and a profile of one generation); serve (`jaxgpt serve`'s app under 1, 16 and 64 streaming clients of the
openai client, against `generate` alone and the engine alone: benchmarks/bench_serve.py's part 1; the host needs the
serving wheels, docs/accelerators.md); tests (`pytest -m accelerator tests/`); train_sweep (what a GPU's defaults
must decide, each candidate compiled in the same process and timed in turns with the recipe, as a ratio over it:
loss layouts, command-buffer types and minimum graph size, the latency-hiding scheduler, batch 64 vs 32 x 2
accumulation, remat; --variants picks some); hf_generate (transformers' cached generation, as generate). The parts
that measure the targets come first, the sweep's settings and transformers' row last: the limits add up to more than
the 9-minute budget, so a run cut short loses those, and a second call with what is left of a GPU's lease runs them
(docs/accelerators.md, "A GPU lent for 15 minutes"). The table ends with the ratios: jaxgpt's to PyTorch's, the
sweep's candidates' to the recipe's, one client's to `generate` alone's, each load's to the engine alone's with as
many, many clients' to one's.

--smoke runs every part on the CPU at tiny shapes (a 2-layer model, 64 positions, a few steps and small
batches); PyTorch's parts are skipped with the reason where torch is not installed, torch.compile is left out
(inductor's C++ build would take most of the smoke's time), and the tests part runs the tests the ordinary
CPU run cannot (two fake CPU devices) and one more: the rest run in every CI run anyway.
tests/integration/test_device_check.py runs the smoke (in the slow tier; a smoke of two parts in every CI run) and
tests/unit/io/test_hf.py its PyTorch parts, so this script cannot rot unnoticed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # jaxgpt and configs/ from the checkout, installed or not

PARTS = ("env", "train", "torch_train", "train_medium", "generate", "serve", "tests", "train_sweep", "hf_generate")
# jaxgpt's imports that accelerator images often lack (docs/accelerators.md lists what must travel as wheels)
OFTEN_MISSING = ("ml_collections", "tensorboardX", "torch", "transformers", "fastapi", "uvicorn", "pydantic",
                 "prometheus_client", "openai")
VERSIONS = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "libtpu", "flax", "optax", "orbax-checkpoint",
            "numpy", "tiktoken", "torch", "transformers", "ml_collections", "tensorboardX")


@dataclasses.dataclass(frozen=True)
class Shapes:
    """What every part runs: GPT-2 124M on a device; a tiny model on the CPU for --smoke."""

    model: dict[str, int]  # changes to configs/gpt2_124m.py's model ({}: GPT-2 124M itself)
    loss_chunk: int | None  # None: the config's
    batches: tuple[int, ...]  # per-device training batches, tried largest first until one fits
    steps: int  # timed training steps, after the warm-up
    prompt_len: int
    new_tokens: int  # generated per row (generate, hf_generate)
    serve_tokens: int  # generated per request (serve)
    gen_batches: tuple[int, ...]
    clients: tuple[int, ...]
    requests: int  # per client, one after another
    compile_torch: bool
    tests: tuple[str, ...]  # pytest's arguments after -m accelerator
    test_workers: int  # > 0: pytest-xdist processes sharing the device (compiling is most of a test's time)
    profile_steps: int  # training steps traced for the profile summary
    wide_loss_chunk: int  # train_sweep: the loss in fewer, larger chunks (besides all logits at once)
    sweep: tuple[str, ...]  # train_sweep's candidates besides the recipe (`candidates`; "all": every one)
    sweep_rounds: int  # train_sweep: turns of every candidate, taken in turn (the fastest counts)
    medium_batches: tuple[int, ...]  # train_medium: per-device batches, largest first
    cpu_devices: int  # > 0: the tests part's XLA CPU devices (XLA_FLAGS)
    budget: float  # seconds for the whole run
    limits: dict[str, float]  # seconds for each part


FULL = Shapes(model={}, loss_chunk=None, batches=(64, 32, 16, 8, 4), steps=10, prompt_len=16, new_tokens=256,
              serve_tokens=64, gen_batches=(1, 64), clients=(1, 16, 64), requests=4, compile_torch=True,
              tests=("tests/",), test_workers=6, profile_steps=3, wide_loss_chunk=512, sweep=("all",),
              sweep_rounds=3, medium_batches=(32, 16, 8), cpu_devices=0, budget=540,
              limits=dict(env=60, tests=150, train=100, train_sweep=180, train_medium=100, torch_train=150,
                          generate=140, hf_generate=90, serve=210))
SMOKE = Shapes(model=dict(vocab_size=512, block_size=64, n_layer=2, n_head=2, n_embd=64), loss_chunk=16,
               batches=(8, 4), steps=2, prompt_len=8, new_tokens=8, serve_tokens=8, gen_batches=(1, 4),
               clients=(1, 4), requests=2, compile_torch=False,
               tests=("tests/unit/test_accelerator.py", "-k", "two_devices or float64_reference"), test_workers=0,
               profile_steps=2, wide_loss_chunk=32, sweep=("loss_chunk0", "accumulate_2_loops_in_graphs"),
               sweep_rounds=1, medium_batches=(4,), cpu_devices=2, budget=480,
               limits=dict(env=60, tests=150, train=90, train_sweep=150, train_medium=60, torch_train=90,
                           generate=90, hf_generate=90, serve=90))


class UnavailableError(Exception):
    """A part that cannot run here (no torch): recorded as skipped, with the reason, rather than as failed."""


def one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


# ----------------------------------------------------------------------------------------------------
# Helpers of the parts (each part runs in its own process: see `run_part`)


def recipe(shapes: Shapes, attention: str | None, config: str = "gpt2_124m", **changes: Any) -> tuple[Any, int]:
    """configs/<config>.py's model (sizes replaced by --smoke's, attention by --attention, then `changes`) and its
    loss chunk."""
    import importlib

    from jaxgpt.train.config import from_config_dict

    run = from_config_dict(importlib.import_module(f"configs.{config}").get_config())
    cfg = run.model.replace(**shapes.model, **({"attention_impl": attention} if attention else {}), **changes)
    return cfg, shapes.loss_chunk or run.loss_chunk


def is_out_of_memory(e: BaseException) -> bool:
    """XLA's RESOURCE_EXHAUSTED and PyTorch's OutOfMemoryError, by their messages (one rule for both)."""
    text = str(e)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def largest_fitting(run: Callable[[int], Any], batches: tuple[int, ...], cleanup: Callable[[], None] = gc.collect
                    ) -> tuple[int, Any, list[str]]:
    """(batch, run(batch)) for the first of `batches` that does not run out of device memory, and the
    out-of-memory lines of the larger ones. Other errors propagate: they are the part's failure. `cleanup` runs
    after the failed attempt's exception, and with it the frames holding its arrays, is gone."""
    misses = []
    for batch in batches:
        try:
            return batch, run(batch), misses
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            misses.append(f"batch {batch}: {one_line(e)}")
            print(misses[-1], flush=True)
        cleanup()
    raise RuntimeError(f"even batch {batches[-1]} ran out of memory")


def batches_of(shapes: Shapes, args: argparse.Namespace) -> tuple[int, ...]:
    return tuple(int(b) for b in args.batches.split(",")) if args.batches else shapes.batches


def accelerator_libraries(device: Any) -> dict[str, Any]:
    """The runtime's version string, and for NVIDIA GPUs the CUDA, cuDNN and driver versions of JAX's plugin."""
    from jaxgpt.ops.platform import is_gpu

    info: dict[str, Any] = {"platform_version": getattr(device.client, "platform_version", None),
                            "compute_capability": getattr(device, "compute_capability", None)}
    try:
        from jax._src.lib import cuda_versions  # JAX keeps them here (private; absent without its CUDA plugin)
    except ImportError:
        cuda_versions = None
    if cuda_versions is not None and is_gpu(device.platform):
        for name in ("cuda_runtime", "cuda_driver", "cudnn", "cublas", "cufft", "cusolver", "cusparse"):
            with contextlib.suppress(Exception):
                info[name] = getattr(cuda_versions, f"{name}_get_version")()
    return info


# ----------------------------------------------------------------------------------------------------
# The parts: each returns {"summary": one line, "metrics": numbers, "details": anything JSON}


def part_env(shapes: Shapes, args: argparse.Namespace) -> dict[str, Any]:
    """What the host is: devices, versions, libraries, memory, missing imports."""
    import importlib.metadata
    import importlib.util
    import platform

    import jax

    from jaxgpt.ops.platform import is_gpu

    print(jax.print_environment_info(return_string=True), flush=True)  # nvidia-smi's table too, where there is one
    devices = jax.devices()
    versions = {}
    for dist in VERSIONS:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[dist] = importlib.metadata.version(dist)
    memory = [d.memory_stats() or {} for d in devices]
    missing = [m for m in OFTEN_MISSING if importlib.util.find_spec(m) is None]
    limit = memory[0].get("bytes_limit")
    summary = (f"{len(devices)} x {devices[0].device_kind} ({devices[0].platform}), jax {jax.__version__}"
               + (f", {limit / 2**30:.1f} GiB usable per device" if limit else "")
               + (f"; missing: {', '.join(missing)}" if missing else ""))
    return {"summary": summary, "metrics": {"device_count": len(devices), "bytes_limit": limit},
            "details": {"device_kind": devices[0].device_kind, "platform": devices[0].platform,
                        "python": sys.version.split()[0], "machine": platform.machine(), "cpus": os.cpu_count(),
                        "versions": versions, "libraries": accelerator_libraries(devices[0]), "memory": memory,
                        "missing_imports": missing,
                        "target_config": gpu_target_config() if is_gpu(devices[0].platform) else None}}


def gpu_target_config() -> str | None:
    """The GpuTargetConfig (text proto) XLA compiles for on this GPU, as it writes it beside a program it dumps:
    what jaxgpt/tools/gpu_targets/ holds for `jaxgpt aot --topology h100:N` (from XLA's specs until a real one
    replaces it)."""
    import jax
    import jax.numpy as jnp

    with tempfile.TemporaryDirectory() as tmp:
        jax.jit(lambda x: x + 1).lower(jnp.zeros(8)).compile(compiler_options={"xla_dump_to": tmp})
        found = sorted(Path(tmp).glob("*gpu_target_config.pbtxt"))
        return found[0].read_text() if found else None


def pytest_counts(output: str) -> dict[str, int]:
    """Outcome counts from pytest's closing line, or, if it never came (a timeout), from its -vv test lines."""
    closing = re.findall(r"^=+ (.+?) in [\d.]+s\b.*=+$", output, re.M)
    if closing:
        return {word.rstrip("s") if word.startswith("error") else word: int(n)
                for n, word in re.findall(r"(\d+) (\w+)", closing[-1])}
    counts: dict[str, int] = {}
    # -vv writes "path::test OUTCOME"; under pytest-xdist, "[gw0] [ 10%] OUTCOME path::test"
    outcomes = r"PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS"
    found = re.findall(rf"^\S+::\S+ ({outcomes})\b|^\[gw\d+\] \[ *\d+%\] ({outcomes}) \S+::", output, re.M)
    for outcome in (a or b for a, b in found):
        key = {"XFAIL": "xfailed", "XPASS": "xpassed"}.get(outcome, outcome.lower())
        counts[key] = counts.get(key, 0) + 1
    return counts


def part_tests(shapes: Shapes, args: argparse.Namespace) -> dict[str, Any]:
    """`pytest -m accelerator` on this backend; its output goes to this part's log."""
    env = {**os.environ, "JAX_DEFAULT_MATMUL_PRECISION": "highest"}
    env.setdefault("JAX_PLATFORMS", "")  # tests/conftest.py pins the CPU unless this is set ("": JAX's choice)
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # small tests; a test's own subprocess needs memory too
    if shapes.cpu_devices:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={shapes.cpu_devices}"
    # A test module that cannot be imported on this host (a package it lacks) is one error, not a stop to the run.
    workers = ["-n", str(shapes.test_workers)] if shapes.test_workers and importlib.util.find_spec("xdist") else []
    cmd = [sys.executable, "-m", "pytest", "-m", "accelerator", *shapes.tests, *workers, "-vv", "-rfE",
           "-p", "no:cacheprovider", "--color=no", "--continue-on-collection-errors", "--durations=10"]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.part_limit - 15)
        output, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:  # keep what it printed: the tests that ran are counted
        output, rc = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace"), None
    print(output, flush=True)
    counts = pytest_counts(output)
    failures = [line[:300] for line in re.findall(r"^(?:FAILED|ERROR) .+$", output, re.M)][:10]
    summary = ", ".join(f"{counts.get(k, 0)} {k}" for k in ("passed", "failed", "error", "skipped"))
    record = {"summary": summary + (" (--smoke's selection)" if args.smoke else ""), "metrics": counts,
              "details": {"command": cmd[1:], "failures": failures}}
    if rc is None:
        return {**record, "status": "timeout", "error": f"pytest still running after {args.part_limit - 15:.0f} s"}
    if rc != 0 or not counts.get("passed"):
        error = failures[0] if failures else f"pytest exit status {rc}" + (": no test selected" if rc == 5 else "")
        return {**record, "status": "failed", "error": error}
    return record


def train_rate(cfg: Any, devices: list, batch: int, step_s: float) -> tuple[float, float | None]:
    """(tokens/s, MFU or None without a published peak) of a step of `batch` rows per device on `devices`."""
    from jaxgpt.train.chips import peak_flops_for
    from jaxgpt.train.flops import flops_per_token

    tok_s = batch * len(devices) * cfg.block_size / step_s
    peak = peak_flops_for(devices)
    return tok_s, tok_s * flops_per_token(cfg) / peak if peak else None


def measure_recipe(cfg: Any, chunk: int, batches: tuple[int, ...], steps: int, options: dict | None = None
                   ) -> dict[str, Any]:
    """A model's train step, data parallel over every device, at the largest per-device batch of `batches` that
    fits, `steps` steps back to back: {"summary", "metrics", "details", "run"} (run: bench_train's runner)."""
    import bench_train
    import jax

    devices = jax.devices()
    n = len(devices)
    batch, (compile_s, run), misses = largest_fitting(
        lambda b: bench_train.prepare_step(cfg, b * n, n_devices=n, loss_chunk=chunk, compiler_options=options),
        batches)
    step_s = run(steps)
    tok_s, mfu = train_rate(cfg, devices, batch, step_s)
    mfu_text = f"MFU {mfu:.1%}" if mfu is not None else f"no published peak for {devices[0].device_kind!r}"
    summary = (f"{tok_s:,.0f} tokens/s, {mfu_text} ({n} x {batch} x {cfg.block_size} tokens per step, "
               f"{step_s * 1e3:.1f} ms; compile {compile_s:.0f} s)")
    metrics = {"tokens_per_s": tok_s, "tokens_per_s_per_device": tok_s / n, "mfu": mfu, "step_s": step_s,
               "compile_s": compile_s, "batch_per_device": batch}
    details = {"model": cfg.to_dict(), "loss_chunk": chunk, "out_of_memory": misses, "compiler_options": options,
               "xla_flags": os.environ.get("XLA_FLAGS", "")}
    return {"summary": summary, "metrics": metrics, "details": details, "run": run}


# On GPUs the recipe is compiled so that its profile runs the CUDA graphs (command buffers) an unprofiled step
# runs: without this XLA launches their kernels one by one while a profiler traces, and the trace shows gaps the
# timed steps do not have. It changes nothing outside a profile.
PROFILE_OPTIONS = {"xla_enable_command_buffers_during_profiling": True}


def part_train(shapes: Shapes, args: argparse.Namespace) -> dict[str, Any]:
    """jaxgpt's GPT-2 124M recipe, data parallel over every device, at the largest batch that fits; then the
    profile of a few of its steps and the optimizer's update alone."""
    import profile_summary

    from jaxgpt.ops.platform import on_gpu

    cfg, chunk = recipe(shapes, args.attention)
    steps = args.steps or shapes.steps
    options = PROFILE_OPTIONS if on_gpu() else None
    measured = measure_recipe(cfg, chunk, batches_of(shapes, args), steps, options)
    run, details, metrics = measured.pop("run"), measured["details"], measured["metrics"]
    print(f"{args.run_part}: {measured['summary']}", flush=True)  # in the log even if the extras run out of time
    errors = details["errors"] = {}  # each extra's failure is recorded here, not as the part's
    with recorded(errors, "profile"):
        details["profile"] = profile = profile_summary.profile_steps(run, shapes.profile_steps)
        print("\n".join(profile_summary.describe(profile, 12)), flush=True)
    del run
    gc.collect()
    with recorded(errors, "optimizer"):
        metrics["optimizer_s"] = optimizer_seconds(cfg, steps)
        print(f"optimizer update alone: {metrics['optimizer_s'] * 1e3:.1f} ms "
              f"({metrics['optimizer_s'] / metrics['step_s']:.1%} of the step)", flush=True)
    return measured


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A setting a GPU's defaults must decide, as changes to the recipe's train step."""

    model: dict[str, Any] = dataclasses.field(default_factory=dict)  # changes to the model config
    loss_chunk: int | None = None  # None: the recipe's
    grad_accum: int = 1  # the same rows per step, in this many micro-batches (a loop in the step)
    options: dict[str, Any] = dataclasses.field(default_factory=dict)  # XLA compile options (DebugOptions fields)


def candidates(shapes: Shapes) -> dict[str, Candidate]:
    """train_sweep's candidates by name: the recipe first, then each a GPU default could change."""
    # loops in graphs: XLA's command-buffer (CUDA graph) types plus WHILE and CONDITIONAL; without them a `while`
    # runs its body's kernels as launches from the host, trip after trip
    from jaxgpt.generate.decode_weights import WHILE_COMMAND_BUFFERS

    return {
        "recipe": Candidate(),
        "loss_chunk0": Candidate(loss_chunk=0),  # all logits at once: fewer, larger kernels, more memory
        f"loss_chunk{shapes.wide_loss_chunk}": Candidate(loss_chunk=shapes.wide_loss_chunk),
        "no_command_buffers": Candidate(options={"xla_gpu_enable_command_buffer": ""}),
        "loops_in_graphs": Candidate(options=WHILE_COMMAND_BUFFERS),
        "graph_min_size_1": Candidate(options={"xla_gpu_graph_min_graph_size": 1}),
        "latency_hiding_scheduler": Candidate(options={"xla_gpu_enable_latency_hiding_scheduler": True}),
        "accumulate_2": Candidate(grad_accum=2),
        "accumulate_2_loops_in_graphs": Candidate(grad_accum=2, options=WHILE_COMMAND_BUFFERS),
        "remat_save_dots": Candidate(model={"remat": "save_dots"}),
    }


def prepare_candidates(chosen: dict[str, Candidate], cfg: Any, chunk: int, rows: int, errors: dict[str, str]
                       ) -> dict[str, tuple[float, Callable[..., float]]]:
    """(compile seconds, runner) of each candidate's step: the first (the recipe) alone, so that XLA's autotuner
    picks its kernels undisturbed and the others reuse its picks for the fusions they share (XLA keeps them for
    the process), then the rest four at a time (XLA compiles outside the GIL); then each warmed up one after
    another (one program's temporaries on the device at a time). A candidate that fails (out of memory, an
    option this XLA lacks) goes to `errors`."""
    import concurrent.futures

    import bench_train

    def prepare(c: Candidate) -> tuple[float, Callable[..., float]]:
        return bench_train.prepare_step(cfg.replace(**c.model), rows, n_devices=1, warm_up=False,
                                        loss_chunk=chunk if c.loss_chunk is None else c.loss_chunk,
                                        grad_accum=c.grad_accum, compiler_options=c.options or None)

    prepared, (first, *rest) = {}, chosen
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = {first: pool.submit(prepare, chosen[first])}
        futures[first].exception()  # waits
        futures.update({name: pool.submit(prepare, chosen[name]) for name in rest})
        for name, future in futures.items():
            with recorded(errors, name):
                prepared[name] = future.result()
    for name in list(prepared):
        with recorded(errors, name):
            prepared[name][1]()  # the warm-up step
            continue
        del prepared[name]
        gc.collect()
    return prepared


def part_train_sweep(shapes: Shapes, args: argparse.Namespace) -> dict[str, Any]:
    """Every candidate of `candidates` (or those --variants names) against the recipe, one device, at the train
    part's batch: each step compiled in this process and timed in turns with the recipe's (`interleaved`: a few
    steps back to back per turn, the fastest turn counts), reported as tokens/s over the recipe's."""
    import bench_train
    import jax

    cfg, chunk = recipe(shapes, args.attention)
    every = candidates(shapes)
    chosen = tuple(args.variants.split(",")) if args.variants else shapes.sweep
    names = list(every) if chosen == ("all",) else ["recipe", *chosen]
    unknown = set(names) - set(every)
    if unknown:
        raise ValueError(f"--variants {','.join(sorted(unknown))}: the candidates are {', '.join(every)}")
    batch = args.batch or batches_of(shapes, args)[0]
    errors: dict[str, str] = {}
    prepared = prepare_candidates({name: every[name] for name in names}, cfg, chunk, batch, errors)
    if "recipe" not in prepared:
        raise RuntimeError(f"the recipe's step did not run: {errors.get('recipe')}")
    per_turn = max(2, (args.steps or shapes.steps) // 3)
    best = bench_train.interleaved({name: lambda run=run: run(per_turn) for name, (_, run) in prepared.items()},
                                   shapes.sweep_rounds)
    metrics = {"batch": batch, "recipe_step_s": best["recipe"],
               **{f"{name}_ratio": best["recipe"] / s for name, s in best.items() if name != "recipe"}}
    ranked = sorted((name for name in best if name != "recipe"), key=lambda name: -metrics[f"{name}_ratio"])
    summary = (f"recipe {batch * cfg.block_size / best['recipe']:,.0f} tokens/s on one {jax.devices()[0].device_kind}; "
               + ", ".join(f"{name} {metrics[f'{name}_ratio']:.2f}x" for name in ranked)
               + (f"; failed: {', '.join(errors)}" if errors else ""))
    details = {"candidates": {name: dataclasses.asdict(every[name]) for name in names}, "errors": errors,
               "compile_s": {name: compile_s for name, (compile_s, _) in prepared.items()}, "step_s": best}
    return {"summary": summary, "metrics": metrics, "details": details}


def part_train_medium(shapes: Shapes, args: argparse.Namespace) -> dict[str, Any]:
    """GPT-2 medium (350M) as configs/gpt2_medium.py sets it, laid out for one GPU node instead of a pod: layers
    unrolled (a scan is a loop on GPUs) and kept for the backward pass (no remat); tokens/s and MFU as train's."""
    cfg, chunk = recipe(shapes, args.attention, "gpt2_medium", scan_layers=False, remat="none")
    measured = measure_recipe(cfg, chunk, shapes.medium_batches, args.steps or shapes.steps)
    del measured["run"]
    return measured


@contextlib.contextmanager
def recorded(errors: dict[str, str], name: str) -> Iterator[None]:
    """Run an optional measurement: its failure becomes errors[name] (and a log line), not the part's."""
    try:
        yield
    except Exception as e:
        errors[name] = one_line(e)
        print(f"{name} failed: {errors[name]}", flush=True)


def optimizer_seconds(cfg: Any, steps: int) -> float:
    """Median seconds of the training step's optimizer update alone (bench_train's optimizer, the model's
    parameters, gradients of ones), jitted with the parameters and state donated as in the step."""
    import functools

    import jax
    import jax.numpy as jnp
    import optax

    from jaxgpt.model.gpt import init_params
    from jaxgpt.train.optim import OptimConfig, make_optimizer

    tx = make_optimizer(OptimConfig(warmup_steps=1, decay_steps=1000))
    params = init_params(cfg, jax.random.key(0))
    state = {"params": params, "opt_state": tx.init(params)}
    grads = jax.tree.map(jnp.ones_like, params)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def update(state: dict, grads: Any) -> tuple[dict, jax.Array]:
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, optax.tree.norm(grads)

    def one() -> float:
        t = time.perf_counter()
        state.update(update(state, grads)[0])
        jax.block_until_ready(state)
        return time.perf_counter() - t

    one()
    return statistics.median(one() for _ in range(steps))


def torch_device(args: argparse.Namespace) -> str:
    """"cuda" on an NVIDIA host, "cpu" for --smoke; elsewhere (a TPU host) PyTorch has no device to compare on."""
    import torch

    if args.smoke:
        return "cpu"
    if not torch.cuda.is_available():
        raise UnavailableError("PyTorch sees no CUDA device (on TPUs jaxgpt has no PyTorch peer here)")
    return "cuda"


def torch_train_seconds(cfg: Any, batch: int, device: str, compile_model: bool, steps: int) -> tuple[float, float]:
    """(seconds of the two warm-up steps, which compile, and the median step) of torch_reference's model trained
    as nanoGPT/llm.c do on a GPU: bf16 autocast, flash SDPA (forced, so that a fallback fails loudly), fused
    AdamW, gradient clipping at 1 as jaxgpt's optimizer clips."""
    import torch
    import torch.nn.functional as F  # noqa: N812 (the PyTorch convention)
    import torch_reference
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.set_default_device(device)  # the model's parameters and its position indices are made there
    model = torch_reference._model(cfg.vocab_size, cfg.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd)
    forward = torch.compile(model) if compile_model else model
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device == "cuda")
    x, y = (torch.randint(0, cfg.vocab_size, (batch, cfg.block_size)) for _ in range(2))
    flash = (lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)) if device == "cuda" else contextlib.nullcontext

    def step() -> float:
        t = time.perf_counter()
        with flash(), torch.autocast(device, dtype=torch.bfloat16):
            loss = F.cross_entropy(forward(x).view(-1, cfg.vocab_size), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    warm_up = step() + step()
    return warm_up, statistics.median(step() for _ in range(steps))


def part_torch_train(shapes: Shapes, args: argparse.Namespace) -> dict[str, Any]:
    """The same model in PyTorch on one device, at jaxgpt's per-device batch (smaller ones if it does not fit)."""
    import torch_reference

    if not torch_reference.available():
        raise UnavailableError("PyTorch is not installed")
    import torch

    device = torch_device(args)
    cfg, _ = recipe(shapes, args.attention)
    batches = batches_of(shapes, args)
    if args.batch:  # jaxgpt's, and smaller ones if PyTorch needs more memory
        batches = tuple(b for b in batches if b <= args.batch) or (args.batch,)
    cleanup = lambda: (gc.collect(), torch.cuda.empty_cache() if device == "cuda" else None)
    batch, (warm_s, step_s), misses = largest_fitting(
        lambda b: torch_train_seconds(cfg, b, device, shapes.compile_torch, args.steps or shapes.steps), batches,
        cleanup)
    tok_s = batch * cfg.block_size / step_s
    how = "torch.compile" if shapes.compile_torch else "eager"
    return {"summary": f"{tok_s:,.0f} tokens/s on one {device} device ({how}, bf16 autocast; batch {batch} x "
                       f"{cfg.block_size}, {step_s * 1e3:.1f} ms; warm-up {warm_s:.0f} s)",
            "metrics": {"tokens_per_s": tok_s, "step_s": step_s, "warm_up_s": warm_s, "batch": batch},
            "details": {"torch": torch.__version__, "device": device, "compiled": shapes.compile_torch,
                        "out_of_memory": misses}}


def part_generate(shapes: Shapes, args: argparse.Namespace) -> dict[str, Any]:
    """jaxgpt's cached greedy generation, bf16, per batch: tokens/s of the best of two warm runs."""
    import jax
    import numpy as np
    from bench_sample import best_seconds, seconds

    from jaxgpt.generate.sampling import generate
    from jaxgpt.model.gpt import init_params

    cfg, _ = recipe(shapes, args.attention)
    params = init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    metrics, prompts = {}, {}
    for batch in shapes.gen_batches:
        prompt = prompts[batch] = rng.integers(0, cfg.vocab_size, (batch, shapes.prompt_len))
        run = lambda prompt=prompt: generate(params, cfg, prompt, max_new_tokens=shapes.new_tokens, temperature=0,
                                             dtype="bfloat16")
        first = seconds(run)
        best = best_seconds(run, 2)
        metrics[f"batch{batch}_tokens_per_s"] = batch * shapes.new_tokens / best
        metrics[f"batch{batch}_compile_s"] = first - best
        print(f"batch {batch}: {metrics[f'batch{batch}_tokens_per_s']:,.0f} tokens/s", flush=True)  # if it stops later
    details = {"attention_impl": cfg.attention_impl, "new_tokens": shapes.new_tokens, "errors": {}}
    with recorded(details["errors"], "generation_targets"):
        details["targets"] = generation_targets(params, cfg, shapes, prompts, metrics, details)
    return {"summary": generation_summary(metrics, shapes), "metrics": metrics, "details": details}


GENERATE_TARGETS = {1: 4_000, 64: 150_000}  # tokens/s on one H100 or H200 (issue 49); other batches: none


def generation_targets(params: Any, cfg: Any, shapes: Shapes, prompts: dict[int, Any], metrics: dict[str, float],
                       details: dict[str, Any]) -> list[str]:
    """Per batch: tokens/s against the target and against the HBM bound (the weights and the rows' KV caches
    read once per token, at the chip's bandwidth: `bench_sample.bytes_per_token`), and against it, interleaved, the
    decode loop compiled as a GPU could compile it instead: with XLA's own settings of the options `generate` sets
    (`decode_weights.XLA_DECODE_DEFAULTS`), without its Triton fusion (`decode_weights.TRITON_FUSION`: fewer
    kernels a token), without its loops in the CUDA graph (`decode_weights.WHILE_COMMAND_BUFFERS`: the whole
    generation one graph), and with XLA's attention in place of the one-kernel decode attention
    (`ops.decode_attention`); then a device profile of one batch-1 generation, which XLA runs kernel by kernel
    under the profiler (inside its one CUDA graph, the loops' conditional nodes, the kernels reach no trace: 1.3 ms
    of 214 on the H200). Lines for the log and the JSON."""
    import jax
    import profile_summary
    from bench_sample import best_seconds, bytes_per_token, compiled_generation

    from jaxgpt.generate.decode_weights import TRITON_FUSION, WHILE_COMMAND_BUFFERS, XLA_DECODE_DEFAULTS
    from jaxgpt.generate.sampling import generate
    from jaxgpt.ops.platform import on_gpu
    from jaxgpt.train.chips import chip_for

    chip = chip_for(jax.devices()[0])

    def xla_own(options: dict[str, Any]) -> dict[str, Any]:
        """`options` left out: their keys at XLA's own settings."""
        return {key: XLA_DECODE_DEFAULTS[key] for key in options}

    # name -> (model, compiler options over generate's): "xla_attention" decodes with XLA's attention instead of the
    # one-kernel cache write and attention (`ops.decode_attention`), which only `attention_impl` "cudnn" (auto) runs
    sweep = {"xla_defaults": (cfg, XLA_DECODE_DEFAULTS),
             "no_triton_fusion": (cfg, xla_own(TRITON_FUSION)),
             "no_while_command_buffers": (cfg, xla_own(WHILE_COMMAND_BUFFERS)),
             "xla_attention": (cfg.replace(attention_impl="xla"), None)} if on_gpu() else {"loop_alone": (cfg, None)}
    default = {batch: lambda prompt=prompt: generate(params, cfg, prompt, max_new_tokens=shapes.new_tokens,
                                                     temperature=0, dtype="bfloat16")
               for batch, prompt in prompts.items()}  # generate's own program, which the variants are timed against
    lines = []
    for batch, prompt in prompts.items():
        got = metrics[f"batch{batch}_tokens_per_s"]
        line = f"batch {batch}: {got:,.0f} tokens/s"
        if batch in GENERATE_TARGETS:
            metrics[f"batch{batch}_target_ratio"] = got / GENERATE_TARGETS[batch]
            line += f", {got / GENERATE_TARGETS[batch]:.2f}x the target {GENERATE_TARGETS[batch]:,}"
        if chip is not None:
            step_bytes = bytes_per_token(cfg, shapes.new_tokens, batch, shapes.prompt_len, itemsize=2)
            bound = metrics[f"batch{batch}_hbm_bound_tokens_per_s"] = batch * chip.hbm_bandwidth / step_bytes
            line += f", {got / bound:.1%} of the HBM bound {bound:,.0f} ({step_bytes / 1e6:,.0f} MB read per token)"
        runs = {name: compiled_generation(params, model, prompt, shapes.new_tokens, options)
                for name, (model, options) in sweep.items()}
        runs = {"default": default[batch], **runs}
        times = {name: [] for name in runs}
        for _ in range(2):  # interleaved
            for name, run in runs.items():
                times[name].append(best_seconds(run, 1))
        for name in sweep:
            ratio = metrics[f"batch{batch}_{name}_ratio"] = min(times["default"]) / min(times[name])
            line += f"; {name.replace('_', ' ')} {ratio:.2f}x the default"
        lines.append(line)
        print(lines[-1], flush=True)
    first = min(prompts)  # profiled as timed: `generate`'s own program, compiled already
    details["profile"] = profile = profile_summary.profile_steps(lambda n: [default[first]() for _ in range(n)], 1)
    lines += [f"profile of one batch-{first} generation of {shapes.new_tokens} tokens (a step below):",
              *profile_summary.describe(profile, 8)]
    print("\n".join(lines[-9:]), flush=True)
    return lines


def generation_summary(metrics: dict[str, float], shapes: Shapes) -> str:
    return "; ".join(f"batch {b}: {metrics[f'batch{b}_tokens_per_s']:,.0f} tokens/s" for b in shapes.gen_batches)


def part_hf_generate(shapes: Shapes, args: argparse.Namespace) -> dict[str, Any]:
    """transformers' cached greedy `generate` on a random GPT2LMHeadModel of the same shape, bf16, per batch."""
    try:
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as e:
        raise UnavailableError(f"{e.name} is not installed") from e
    from bench_sample import best_seconds, seconds

    device = torch_device(args)
    cfg, _ = recipe(shapes, args.attention)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd, n_layer=cfg.n_layer,
                        n_head=cfg.n_head, bos_token_id=0, eos_token_id=None)
    model = GPT2LMHeadModel(config).to(device=device, dtype=torch.bfloat16).eval()
    metrics = {}
    for batch in shapes.gen_batches:
        ids = torch.randint(0, cfg.vocab_size, (batch, shapes.prompt_len), device=device)

        def run(ids: Any = ids) -> None:
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=shapes.new_tokens,
                                 min_new_tokens=shapes.new_tokens, do_sample=False, use_cache=True, pad_token_id=0,
                                 eos_token_id=None)
            assert out.shape[1] == shapes.prompt_len + shapes.new_tokens, out.shape
            if device == "cuda":
                torch.cuda.synchronize()

        with torch.inference_mode():
            first = seconds(run)
            best = best_seconds(run, 2)
        metrics[f"batch{batch}_tokens_per_s"] = batch * shapes.new_tokens / best
        metrics[f"batch{batch}_warm_up_s"] = max(first - best, 0.0)  # eager: noise may make the first the fastest
    return {"summary": generation_summary(metrics, shapes), "metrics": metrics,
            "details": {"transformers": sys.modules["transformers"].__version__, "device": device}}


def part_serve(shapes: Shapes, args: argparse.Namespace) -> dict[str, Any]:
    """`jaxgpt serve`'s processes on 127.0.0.1 (the engine's in this one, one slot per client of the largest load;
    an HTTP front end in another) with GPT-2's tokenizer, under 1 to many streaming clients of the openai client,
    against `generate` alone and the engine alone with as many requests at once (the ceiling each load is a ratio
    of): benchmarks/bench_serve.py's part 1 (`measure`) at this run's shapes."""
    import jax

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_serve

    from jaxgpt.data.tokenizer import load_bpe
    from jaxgpt.model.gpt import init_params

    cfg, _ = recipe(shapes, args.attention)
    tokenizer = load_bpe("gpt2")
    work = bench_serve.Workload(lengths=(shapes.prompt_len, shapes.prompt_len),
                                vocab=min(cfg.vocab_size, tokenizer.vocab_size), new_tokens=shapes.serve_tokens,
                                clients=shapes.clients, requests=shapes.requests)
    got = bench_serve.measure("serve", cfg, init_params(cfg, jax.random.key(0)), tokenizer, work,
                              slots=max(shapes.clients))
    rows = [f"generate alone {got['generate_tokens_per_s']:,.0f} tokens/s"]
    rows += [f"{n} client{'s' * (n > 1)} {got[f'clients{n}_tokens_per_s']:,.0f} (engine alone "
             f"{got[f'engine{n}_tokens_per_s']:,.0f}; TTFT p50/p99 {got[f'clients{n}_ttft_p50_s'] * 1e3:.0f}/"
             f"{got[f'clients{n}_ttft_p99_s'] * 1e3:.0f} ms, ITL p50 {got[f'clients{n}_itl_p50_s'] * 1e3:.2f} ms)"
             for n in shapes.clients]
    return {"summary": "; ".join(rows), "metrics": got,
            "details": {"slots": max(shapes.clients), "requests_per_client": shapes.requests,
                        "new_tokens": shapes.serve_tokens, "prompt_len": shapes.prompt_len,
                        "attention_impl": cfg.attention_impl, "targets": bench_serve.targets(got)}}


PART_FUNCTIONS: dict[str, Callable[[Shapes, argparse.Namespace], dict[str, Any]]] = {
    "env": part_env, "tests": part_tests, "train": part_train, "train_sweep": part_train_sweep,
    "train_medium": part_train_medium, "torch_train": part_torch_train, "generate": part_generate,
    "hf_generate": part_hf_generate, "serve": part_serve}


def child(args: argparse.Namespace) -> int:
    """Run one part in this process and write its record to --result (a failure's one-line error first)."""
    result = Path(args.result)
    try:
        record = PART_FUNCTIONS[args.run_part](SMOKE if args.smoke else FULL, args)
    except UnavailableError as e:
        record = {"status": "skipped", "error": str(e)}
    except BaseException as e:
        result.write_text(json.dumps({"status": "failed", "error": one_line(e)}))
        raise
    result.write_text(json.dumps(record, default=str))
    print(f"{args.run_part}: {record.get('summary') or record.get('error')}")
    return 0


# ----------------------------------------------------------------------------------------------------
# The parent: parts in subprocesses, then the table and the JSON


def part_environment(name: str, smoke: bool) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if smoke:
        env["JAX_PLATFORMS"] = "cpu"
    if name.startswith("train"):  # the largest batch that fits: let JAX's allocator take most of the device, as
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")  # PyTorch may
    return env


def run_part(name: str, limit: float, args: argparse.Namespace, extra: list[str], log: Path) -> dict[str, Any]:
    """One part in a new process group, killed whole at `limit` seconds; its record, status and log tail (the
    whole output goes to `log`)."""
    forwarded = [*(["--smoke"] if args.smoke else []), *(["--steps", str(args.steps)] if args.steps else []),
                 *(["--variants", args.variants] if args.variants else []),
                 *(["--attention", args.attention] if args.attention else []),
                 *(["--batches", args.batches] if args.batches else [])]
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--run_part", name, "--result", str(result),
               "--part_limit", str(limit), *forwarded, *extra]
        t0 = time.monotonic()
        with log.open("wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                    env=part_environment(name, args.smoke), start_new_session=True)
            try:
                rc = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                rc = None
            with contextlib.suppress(ProcessLookupError):  # its group: pytest's and the compilers' children too
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        seconds = time.monotonic() - t0
        record = json.loads(result.read_text()) if result.exists() else {}
    tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-40:]
    status = record.pop("status", None) or ("ok" if rc == 0 else "timeout" if rc is None else "failed")
    if status in ("failed", "timeout") and not record.get("error"):
        record["error"] = (f"no result within its {limit:.0f} s limit" if rc is None else
                           f"exit status {rc}: {tail[-1][:300] if tail else 'no output'}")
    return {"status": status, "seconds": round(seconds, 1), "summary": "", "metrics": {}, "details": {}, **record,
            "log": str(log), "log_tail": tail}


def comparisons(records: dict[str, dict[str, Any]], shapes: Shapes) -> dict[str, float]:
    """jaxgpt over PyTorch (training tokens/s per device, cached generation's tokens/s per batch), the training
    variants over the recipe, and the engine's most clients over its fewest."""
    get = lambda part, key: records.get(part, {}).get("metrics", {}).get(key)
    out = {}
    if get("train", "tokens_per_s_per_device") and get("torch_train", "tokens_per_s"):
        out["training tokens/s per device: jaxgpt / PyTorch"] = (get("train", "tokens_per_s_per_device")
                                                                 / get("torch_train", "tokens_per_s"))
    for b in shapes.gen_batches:
        ours, theirs = get("generate", f"batch{b}_tokens_per_s"), get("hf_generate", f"batch{b}_tokens_per_s")
        if ours and theirs:
            out[f"cached generation at batch {b}: jaxgpt / transformers"] = ours / theirs
    for key, ratio in records.get("train_sweep", {}).get("metrics", {}).items():
        if key.endswith("_ratio"):
            out[f"training tokens/s, {key.removesuffix('_ratio')} / the recipe's"] = ratio
    low = min(shapes.clients)
    if get("serve", f"clients{low}_tokens_per_s") and get("serve", "generate_tokens_per_s"):
        out[f"serving tokens/s, {low} client / generate alone"] = (get("serve", f"clients{low}_tokens_per_s")
                                                                   / get("serve", "generate_tokens_per_s"))
    for n in shapes.clients:
        if get("serve", f"clients{n}_tokens_per_s") and get("serve", f"engine{n}_tokens_per_s"):
            out[f"serving tokens/s, {n} client{'s' * (n > 1)} / the engine alone with {n}"] = (
                get("serve", f"clients{n}_tokens_per_s") / get("serve", f"engine{n}_tokens_per_s"))
    for high in shapes.clients[1:]:
        if get("serve", f"clients{low}_tokens_per_s") and get("serve", f"clients{high}_tokens_per_s"):
            out[f"serving tokens/s, {high} clients / {low}"] = (get("serve", f"clients{high}_tokens_per_s")
                                                               / get("serve", f"clients{low}_tokens_per_s"))
    return out


def report(records: dict[str, dict[str, Any]], ratios: dict[str, float], header: str) -> None:
    print(f"\n{header}\n{'part':<13}{'status':<9}{'seconds':>8}  result")
    for name, r in records.items():
        text = r["summary"] if r["status"] == "ok" else "; ".join(filter(None, [r["summary"], r.get("error")]))
        print(f"{name:<13}{r['status']:<9}{r['seconds']:>8.1f}  {text}")
    for what, ratio in ratios.items():
        print(f"{what}: {ratio:.2f}x")


def default_out(records: dict[str, dict[str, Any]]) -> Path:
    kind = records.get("env", {}).get("details", {}).get("device_kind", "unknown")
    slug = re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-") or "unknown"
    return ROOT / "benchmarks" / "results" / f"device_check-{slug}-{datetime.date.today().isoformat()}.json"


def write_results(out: Path, records: dict[str, dict[str, Any]], logs: Path, args: argparse.Namespace,
                  elapsed: float) -> tuple[str, dict[str, float]]:
    """The JSON, and the logs so far in the folder beside it named after it: rewritten after every part, so
    that a run stopped from outside (a lease running out) still leaves what it measured. (header, ratios)."""
    kept = out.with_name(out.stem + "-logs")
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(logs, kept, dirs_exist_ok=True)
    for name, r in records.items():
        r["log"] = str(kept / f"{name}.log") if (logs / f"{name}.log").exists() else None
    shapes = SMOKE if args.smoke else FULL
    ratios = comparisons(records, shapes)
    env = records.get("env", {}).get("summary") or "environment unknown"
    header = (f"device_check{' --smoke' if args.smoke else ''}: {env}; {elapsed:.0f} s in all, "
              f"{datetime.datetime.now().isoformat(timespec='seconds')}")
    out.write_text(json.dumps({"header": header, "smoke": args.smoke, "argv": sys.argv[1:],
                               "budget_s": args.budget or shapes.budget, "total_s": round(elapsed, 1),
                               "parts": records, "comparisons": ratios}, indent=1, default=str) + "\n")
    return header, ratios


def parent(args: argparse.Namespace) -> int:
    """Every selected part in turn within the budget, the results written after each; the table. Exit status 1
    if a part failed or ran out of time."""
    shapes = SMOKE if args.smoke else FULL
    limits = {**shapes.limits, **{k: float(v) for k, v in (item.split("=", 1) for item in args.limit)}}
    budget = args.budget or shapes.budget
    start, records = time.monotonic(), {}
    where = lambda: Path(args.out) if args.out else default_out(records)  # default_out names the device: after env
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp)
        for name in args.parts.split(","):
            left = budget - (time.monotonic() - start)
            if left < 20:
                records[name] = {"status": "skipped", "seconds": 0.0, "summary": "", "metrics": {}, "details": {},
                                 "error": f"the run's --budget of {budget:.0f} s was spent"}
                continue
            train_batch = records.get("train", {}).get("metrics", {}).get("batch_per_device")
            extra = ["--batch", str(train_batch)] if name in ("torch_train", "train_sweep") and train_batch else []
            print(f"{name}: running (limit {min(limits[name], left):.0f} s)", flush=True)
            records[name] = r = run_part(name, min(limits[name], left), args, extra, logs / f"{name}.log")
            print(f"{name}: {r['status']} in {r['seconds']:.0f} s: {r['summary'] or r.get('error')}", flush=True)
            if len(records) == 1:  # an earlier run's logs under the same name go
                shutil.rmtree(where().with_name(where().stem + "-logs"), ignore_errors=True)
            write_results(where(), records, logs, args, time.monotonic() - start)
        out = where()
        header, ratios = write_results(out, records, logs, args, time.monotonic() - start)
    report(records, ratios, header)
    print(f"written: {out} (whole logs in {out.stem}-logs/ beside it)")
    return int(any(r["status"] in ("failed", "timeout") for r in records.values()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="every part at tiny shapes on the CPU")
    parser.add_argument("--out", help="the JSON file (default benchmarks/results/device_check-<device>-<date>.json)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, run in this order (default "
                        f"{','.join(PARTS)})")
    parser.add_argument("--budget", type=float, help=f"seconds for the whole run (default {FULL.budget:.0f}; "
                        f"--smoke {SMOKE.budget:.0f})")
    parser.add_argument("--limit", action="append", default=[], metavar="PART=SECONDS", help="one part's time limit")
    parser.add_argument("--steps", type=int, help="timed training steps (default 10; --smoke 2)")
    parser.add_argument("--batches", help="per-device training batches to try, largest first (default "
                        f"{','.join(map(str, FULL.batches))})")
    parser.add_argument("--variants", nargs="?", const="", help="train_sweep's candidates besides the recipe, "
                        "comma-separated, or all (default: all; --smoke: two; see `candidates`)")
    parser.add_argument("--attention", help="the model's attention_impl instead of the recipe's auto (e.g. xla)")
    parser.add_argument("--run_part", choices=PARTS, help=argparse.SUPPRESS)  # a part's own process
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--part_limit", type=float, default=600.0, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)  # torch_train: jaxgpt's per-device batch
    args = parser.parse_args()
    unknown = set(args.parts.split(",")) - set(PARTS)
    if unknown or any(item.split("=")[0] not in PARTS for item in args.limit):
        parser.error(f"parts are {', '.join(PARTS)}")
    return child(args) if args.run_part else parent(args)


if __name__ == "__main__":
    sys.exit(main())
