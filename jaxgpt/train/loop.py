"""The training loop: a task -> sharded state -> compiled steps -> logs and checkpoints.

One loop for every task (`jaxgpt.train.task.Task`, made by `jaxgpt.tasks.build`). Everything a step needs is a
function of (config, step): the batch comes from `task.train_rows(step, ...)`, dropout from `fold_in(key, step)`,
so resuming from a checkpoint replays exactly what an uninterrupted run would have done.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from tqdm import tqdm

from jaxgpt import storage
from jaxgpt.errors import StorageError, UserError
from jaxgpt.io.checkpoint import Checkpointer, state_bytes
from jaxgpt.train import optim, resume, rundir, runtime
from jaxgpt.train import sharding as layout
from jaxgpt.train.chips import peak_flops_for
from jaxgpt.train.config import TrainConfig
from jaxgpt.train.flops import flops_per_token, measure_matmul_peak
from jaxgpt.train.interrupt import GracefulStop
from jaxgpt.train.logs import MetricsLog, progress_line, require_wandb
from jaxgpt.train.task import Task


def micro_batches(x: np.ndarray, grad_accum: int) -> np.ndarray:
    """(b, ...) local rows -> (A, b/A, ...), interleaved so each process's rows stay contiguous per micro-batch."""
    b = x.shape[0]
    return np.swapaxes(x.reshape(b // grad_accum, grad_accum, *x.shape[1:]), 0, 1)


def train(cfg: TrainConfig, make_task: Callable[[TrainConfig], Task]) -> dict[str, Any]:
    """Run (or resume) training as configured; returns the final metrics, state and model config.

    The task is `make_task(cfg)`: `jaxgpt.tasks.build` for the one `cfg.task` names, or any class with the `Task`
    methods, which trains here unchanged. It is made after the runtime is set up (devices, compile cache, hosts),
    which must precede anything a task computes. The run owns its work directory while it trains
    (`rundir.WorkdirLock`).
    """
    runtime.setup(cfg)
    if cfg.wandb.project and jax.process_index() == 0:
        require_wandb(cfg.wandb.project)
    task = make_task(cfg)
    workdir = runtime.check_workdir(cfg.workdir)
    rundir.check_not_foreign(workdir)
    lock = rundir.claim(workdir, cfg.lease_seconds) if jax.process_index() == 0 else None
    try:
        return _train(cfg, task, workdir, lock)
    finally:
        if lock is not None:
            lock.release()


def _train(cfg: TrainConfig, task: Task, workdir: storage.Location, lock: rundir.Hold | None
           ) -> dict[str, Any]:
    """`train` once the work directory is this run's: nothing in it changes before every check has passed."""
    is_main = jax.process_index() == 0
    mesh = layout.make_mesh(cfg.mesh.shape)
    prog = layout.build_program(task, cfg.optim, mesh, cfg.batch_size, cfg.grad_accum)
    init_key, dropout_key = jax.random.split(jax.random.key(cfg.seed))
    ckpt = Checkpointer(workdir, keep=cfg.keep_checkpoints)
    trajectory = resume.trajectory(cfg, task.model_cfg.to_dict(), task.meta)
    meta = {"model": task.model_cfg.to_dict(), "config": cfg.settings, "tokenizer": task.tokenizer_meta, **task.meta,
            "trajectory": trajectory}
    # Weights from elsewhere are read outside the mesh context, as plain host arrays.
    pretrained = task.pretrained() if ckpt.latest_step() is None else None
    if is_main and task.describe():
        print(task.describe(), flush=True)
    with prog.activate():
        state, start = _initial_state(cfg, task, ckpt, prog, init_key, pretrained, trajectory)
        if start >= cfg.max_steps:
            ckpt.close()
            return _finished(cfg, task, workdir, state, start)
        _check_space(ckpt, prog.abstract_state)
        feed = Feed(cfg, task, prog, mesh)
        if is_main:
            lock.record_holder()
            rundir.record_start(workdir, cfg.settings, start)
            for name, text in getattr(task, "run_files", {}).items():
                storage.write_text(workdir / name, text)
            n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(state["params"]))
            print(f"model: {n_params:,} parameters; mesh {dict(mesh.shape)}; "
                  f"{'resuming at step ' + str(start) if start else 'starting from step 0'}", flush=True)
            if cfg.optim.optimizer == "muon":
                print(optim.describe_groups(prog.param_axes, state["params"], cfg.optim), flush=True)
        t0 = time.perf_counter()
        options = {"xla_gpu_deterministic_ops": True} if cfg.deterministic else None
        step_fn = prog.train_step.lower(state, feed.batch(start, state["params"]), dropout_key, *prog.frozen).compile(
            compiler_options=options)
        compiled = lambda state, batch, key: step_fn(state, batch, key, *prog.frozen)
        compile_s = time.perf_counter() - t0
        meter = Meter(cfg, task, workdir, start, is_main)
        with GracefulStop() as stop:
            try:
                state, last_eval = _steps(cfg, task, compiled, state, start, dropout_key, feed, meter, ckpt, meta,
                                          stop, lock)
            finally:  # a save in flight must commit even when training stops early, or it is silently lost
                _close(meter, ckpt)
    summary = _throughput(task, cfg.batch_size, meter.n_timed, meter.t_train, compile_s, meter.published_peak)
    if is_main:
        print(summary["report"], flush=True)
        if last_eval and task.final_line(last_eval):
            print(task.final_line(last_eval), flush=True)
        print(_outputs_report(cfg, workdir), flush=True)
    multihost_utils.sync_global_devices("jaxgpt-train-end")
    return {**last_eval, **summary, "steps": cfg.max_steps - start, "state": state, "model_cfg": task.model_cfg,
            "tokenizer_meta": task.tokenizer_meta}


def _steps(cfg: TrainConfig, task: Task, compiled: Any, state: dict, start: int, dropout_key: jax.Array,
           feed: Feed, meter: Meter, ckpt: Checkpointer, meta: dict[str, Any], stop: GracefulStop,
           lock: rundir.Hold | None) -> tuple[dict, dict[str, Any]]:
    """Steps start..max_steps: train, log, evaluate, save (every ckpt_interval steps, after evaluations, and
    every ckpt_minutes); on a stop signal save and raise. Returns the final state and the last evaluation.

    The device never waits for the host between steps: the next step's batch is made and sent while a step runs
    (dispatch is asynchronous), and a log interval's metrics are fetched one step late, once the next step is
    queued. Steps that evaluate or save fetch theirs at once: a non-finite loss stops the run before any save."""
    last_eval: dict[str, Any] = {}
    last_save = time.monotonic()
    batch, due = feed.batch(start, state["params"]), None
    for step in range(start, cfg.max_steps):
        if lock is not None:
            lock.check()  # a run whose lease was taken over must not write another checkpoint
        state, metrics = compiled(state, batch, dropout_key)
        done = step + 1
        if done < cfg.max_steps:  # the next batch goes to the devices while this step runs
            batch = feed.batch(done, state["params"])
        if due is not None:  # the last log interval's metrics, now that this step is queued behind them
            meter.flush(due, ckpt)
            due = None
        meter.queue(done, metrics)
        is_eval = done % cfg.eval_interval == 0 or done == cfg.max_steps
        if is_eval or done % cfg.ckpt_interval == 0:
            meter.flush(done, ckpt)
        elif done % cfg.log_interval == 0:
            due = done
        if is_eval:
            with meter.paused():  # evaluation stays out of tokens/s
                last_eval = feed.evaluate(state["params"])
                meter.write_eval(done, last_eval, task.eval_line(done, last_eval))
        timed = cfg.ckpt_minutes > 0 and _agreed(time.monotonic() - last_save > 60 * cfg.ckpt_minutes, done,
                                                 cfg.log_interval)
        saved = is_eval or done % cfg.ckpt_interval == 0 or timed
        if saved:
            if timed:
                meter.flush(done, ckpt)
            ckpt.save(state, {**meta, **({"val_loss": last_eval["val_loss"]} if is_eval else {})})
            meter.log.sync()
            last_save = time.monotonic()
        if done < cfg.max_steps and _agreed(stop.requested, done, cfg.log_interval):
            meter.flush(done, ckpt)
            if not saved:
                ckpt.save(state, meta)
            ckpt.wait()
            meter.log.sync()
            raise stop.stopped(done, ckpt.directory)
    meter.flush(cfg.max_steps, ckpt)
    return state, last_eval


class Feed:
    """The global batches of the run: each process reads only the rows its devices hold (all of them when the
    batch is replicated over hosts) and assembles them into sharded arrays."""

    def __init__(self, cfg: TrainConfig, task: Task, prog: layout.Program, mesh: jax.sharding.Mesh) -> None:
        self.cfg, self.task, self.prog = cfg, task, prog
        A = cfg.grad_accum
        self.train_spans = layout.local_rows(layout.batch_sharding(mesh, 1, leading=1), (A, cfg.batch_size // A),
                                             dim=1)
        eval_spans = layout.local_rows(layout.batch_sharding(mesh, 1), (task.eval_rows_per_batch,), dim=0)
        self.evals = {split: [self._global(prog.eval_sh, rows, task.eval_rows_per_batch) for rows in batches]
                      for split, batches in layout.read_rows(task.eval_rows, eval_spans,
                                                             task.eval_rows_per_batch).items()}
        self.benchmark_rows = layout.batch_sharding(mesh, 2) if hasattr(task, "benchmarks") else None

    @staticmethod
    def _global(shardings: dict, rows: dict[str, np.ndarray], n_rows: int, leading: tuple = ()) -> dict:
        return {k: layout.global_array(shardings[k], v, (*leading, n_rows, *v.shape[1 + len(leading):]))
                for k, v in rows.items()}

    def batch(self, step: int, params: Any) -> dict[str, jax.Array]:
        """The batch of `step`, split into grad_accum micro-batches; `params`, the weights the step starts from, go
        first to a task whose rows are sampled from them (`use_weights`: rl)."""
        self._use_weights(params)
        A, B = self.cfg.grad_accum, self.cfg.batch_size
        rows = layout.read_rows(lambda i, n: self.task.train_rows(step, i, n), self.train_spans, B, unit=A)
        return self._global(self.prog.batch_sh, {k: micro_batches(v, A) for k, v in rows.items()}, B // A,
                            leading=(A,))

    def _use_weights(self, params: Any) -> None:
        if hasattr(self.task, "use_weights"):
            self.task.use_weights(params)

    def evaluate(self, params: Any) -> dict[str, Any]:
        self._use_weights(params)
        run = lambda b: self.prog.eval_step(params, b, *self.prog.frozen)
        metrics = self.task.summarize({split: jax.device_get([run(b) for b in batches])
                                       for split, batches in self.evals.items()})
        return metrics | (self.task.benchmarks(params, self.benchmark_rows) if self.benchmark_rows else {})


class Meter:
    """What the run reports while it trains: metrics.jsonl/TensorBoard rows, the progress bar (or plain lines in
    a log file), tokens/s and MFU. Step metrics are queued and fetched from the devices once per log interval."""

    def __init__(self, cfg: TrainConfig, task: Task, workdir: storage.Location, start: int,
                 is_main: bool) -> None:
        self.cfg, self.task, self.is_main = cfg, task, is_main
        self.log = MetricsLog(workdir, start, cfg.settings, cfg.wandb.project, cfg.wandb.name, cfg.tensorboard)
        self.plain = is_main and not sys.stderr.isatty()  # a log file gets lines, not a bar's \r updates
        self.bar = tqdm(total=cfg.max_steps, initial=start, disable=not is_main or self.plain, unit="step",
                        dynamic_ncols=True)
        self.pending: list[tuple[int, Any]] = []
        self.tokens_per_step = cfg.batch_size * task.tokens_per_row
        self.t_start = self.t_log = time.perf_counter()
        self.n_timed, self.t_train = 0, 0.0
        self.published_peak = peak_flops_for(jax.devices())  # None on CPUs, which have no published peak

    def queue(self, step: int, metrics: Any) -> None:
        self.pending.append((step, metrics))
        self.bar.update(1)

    @contextlib.contextmanager
    def paused(self) -> Any:
        t = time.perf_counter()
        yield
        self.t_log += time.perf_counter() - t

    def flush(self, step: int, ckpt: Checkpointer) -> None:
        """Fetch the queued step metrics and report them; stop on a non-finite loss before anything is saved."""
        if not self.pending:
            return
        fetched = jax.device_get([m for _, m in self.pending])
        elapsed = time.perf_counter() - self.t_log
        self.t_train += elapsed
        tok_s = self.tokens_per_step * len(self.pending) / elapsed
        for (s, _), m in zip(self.pending, fetched, strict=True):
            if not np.isfinite(m["loss"]):
                raise UserError(f"loss is {m['loss']} at step {s}: training stopped; the last good checkpoint "
                                f"(step {ckpt.latest_step()}) is kept. Lower optim.lr or raise optim.warmup_steps")
        self.n_timed += len(self.pending)
        self._report(step, {k: float(v) for k, v in fetched[-1].items()}, tok_s)
        self.pending.clear()
        self.t_log = time.perf_counter()

    def _report(self, step: int, last: dict[str, float], tok_s: float) -> None:
        terms = {f"train_{k}": v for k, v in last.items() if k not in ("loss", "lr", "grad_norm")}
        mfu = None if self.published_peak is None else _model_flops(self.task, tok_s) / self.published_peak
        record = {"train_loss": last["loss"], **terms, "lr": last["lr"], "grad_norm": last["grad_norm"],
                  "tokens_per_sec": tok_s, **({"mfu": mfu} if mfu is not None else {})}
        self.log.write(step, record)
        self.bar.set_postfix(loss=f"{last['loss']:.4f}", lr=f"{last['lr']:.2e}", tok_s=f"{tok_s:,.0f}",
                             **({"mfu": f"{mfu:.1%}"} if mfu is not None else {}))
        if self.plain:
            print(progress_line(step, self.cfg.max_steps, record, time.perf_counter() - self.t_start),
                  file=sys.stderr, flush=True)

    def write_eval(self, step: int, values: dict[str, Any], line: str) -> None:
        self.log.write(step, values, kind="eval")
        if self.is_main:
            self.bar.write(line)


def _agreed(wanted: bool, done: int, log_interval: int) -> bool:
    """Whether every process acts (stops, or saves on the clock) after step `done`: at once with one process;
    with several, at the next log interval when any wants it, and then all together (a process acting alone
    would leave the others hanging in a collective)."""
    if jax.process_count() == 1:
        return wanted
    if done % log_interval:
        return False
    return bool(np.max(multihost_utils.process_allgather(np.int32(wanted))))


def _close(meter: Meter, ckpt: Checkpointer) -> None:
    """Wait for the last save to commit, then close everything, even when the wait failed (a full disk).

    When the run is ending because its bucket cannot be reached, nothing more is tried there: each attempt
    would wait out the clients' retries first, and the checkpoints already committed are what is kept.
    """
    meter.bar.close()
    if isinstance(sys.exc_info()[1], StorageError):
        meter.log.close(upload=False)
        return
    try:
        ckpt.wait()
    finally:
        with contextlib.suppress(Exception):  # after a failed wait, close raises the same error again
            ckpt.close()
        meter.log.close()


def _check_space(ckpt: Checkpointer, abstract_state: dict[str, Any]) -> None:
    """Refuse to start (before compiling) when the checkpoint directory cannot hold even one checkpoint."""
    need = state_bytes([abstract_state["params"], abstract_state["opt_state"]])
    free = storage.free_bytes(ckpt.directory)
    if free < need:
        raise UserError(f"{ckpt.directory} has {free / 2**20:,.1f} MiB free, but a checkpoint of this run needs about "
                        f"{need / 2**20:,.1f} MiB: free space there or choose another --config.workdir")


def _finished(cfg: TrainConfig, task: Task, workdir: storage.Location, state: dict, start: int
              ) -> dict[str, Any]:
    """A resumed run with nothing left to do says so (no throughput of zero steps) and returns its state."""
    if jax.process_index() == 0:
        print(f"{workdir} is already trained to step {start} (config.max_steps={cfg.max_steps}): nothing to do; "
              "raise --config.max_steps to train further", flush=True)
    return {"steps": 0, "state": state, "model_cfg": task.model_cfg, "tokenizer_meta": task.tokenizer_meta}


def _outputs_report(cfg: TrainConfig, workdir: storage.Location) -> str:
    """Where the run's outputs are, and the commands that use them."""
    figure = "curves.png" if storage.is_bucket(workdir) else workdir / "curves.png"
    outputs = ["checkpoints/", "metrics.jsonl", *["tensorboard/"] * cfg.tensorboard, "config.json"]
    lines = [f"outputs in {workdir}: {', '.join(outputs)}",
             f"  plot:   jaxgpt plots curves --workdir {workdir} --out {figure}"]
    if cfg.tensorboard:
        lines.append(f"  logs:   tensorboard --logdir {workdir / 'tensorboard'}")
    if cfg.task == "lm":
        lines.insert(1, f"  sample: jaxgpt sample --workdir {workdir} --prompt \"...\"")
    return "\n".join(lines)


def _initial_state(cfg: TrainConfig, task: Task, ckpt: Checkpointer, prog: layout.Program, key: jax.Array,
                   pretrained: Any = None, trajectory: dict[str, Any] | None = None) -> tuple[dict, int]:
    """Resume from the latest checkpoint, or initialize (from scratch or from pretrained weights) directly sharded.

    Pretrained weights may lack top-level subtrees of the model (a classifier's new head): those are
    initialized, and XLA drops the rest of the (discarded) full initialization.
    """
    latest = ckpt.latest_step()
    if latest is not None:
        if not cfg.resume:
            raise UserError(f"{cfg.workdir} already holds checkpoints (latest step {latest}): pass "
                            "--config.resume=True to continue, or choose a new --config.workdir")

        def check(saved_meta: dict[str, Any]) -> None:
            task.check_resume(saved_meta, cfg.workdir)
            resume.check_same_run(saved_meta, trajectory or {}, cfg)

        return resume.restore_readable(cfg, ckpt, prog.abstract_state, check)
    param_sh = prog.state_sh["params"]
    example = task.example_inputs()
    missing = sorted(set(param_sh) - set(pretrained or {})) if pretrained is not None else sorted(param_sh)

    def init(k: jax.Array) -> dict:  # the model traced once, not once per name
        full = nn.unbox(task.model.init(k, *example)["params"])
        return {name: full[name] for name in missing}

    fresh = jax.jit(init, out_shardings={name: param_sh[name] for name in missing})(key)
    params = {**fresh, **(jax.device_put({k: v for k, v in pretrained.items() if k in param_sh},
                                         {k: param_sh[k] for k in pretrained if k in param_sh})
                          if pretrained is not None else {})}
    shapes = jax.tree.map(lambda s: s.shape, prog.abstract_state["params"])
    if jax.tree.map(lambda a: a.shape, params) != shapes:
        raise UserError("the initial weights do not match the model's parameter shapes (corrupt checkpoint?)")
    opt_state = jax.jit(prog.tx.init, out_shardings=prog.state_sh["opt_state"])(params)
    return {"params": params, "opt_state": opt_state,
            "step": jax.device_put(jnp.zeros((), jnp.int32), prog.state_sh["step"])}, 0


def _model_flops(task: Task, tok_s: float) -> float:
    """Model FLOP/s at `tok_s` tokens/s (6N + attention per token, `jaxgpt.train.flops`)."""
    return tok_s * flops_per_token(task.model_cfg, task.tokens_per_row)


def _throughput(task: Task, batch_size: int, n_steps: int, seconds: float, compile_s: float,
                published_peak: float | None) -> dict[str, Any]:
    """Tokens/s and MFU of the run: against the chips' published bf16 peak on TPUs and GPUs (comparable with
    other trainers' MFU), against a matmul measured here on CPUs (fake CPU devices share the same cores)."""
    tokens = n_steps * batch_size * task.tokens_per_row
    tok_s = tokens / seconds if seconds else 0.0
    model_flops = _model_flops(task, tok_s)
    peak = published_peak
    against = "the chips' published bf16 peak"
    if peak is None:
        peak, against = measure_matmul_peak(), "the measured matmul peak"
    report = (f"throughput: {tok_s:,.0f} tokens/s over {n_steps} steps (compile {compile_s:.1f} s); model "
              f"{model_flops / 1e9:,.1f} GFLOP/s = MFU {model_flops / peak:.1%} of {against} "
              f"({peak / 1e9:,.0f} GFLOP/s)")
    return {"tokens_per_sec": tok_s, "model_flops_per_sec": model_flops, "mfu": model_flops / peak,
            "peak_flops": peak, "compile_seconds": compile_s, "report": report}
