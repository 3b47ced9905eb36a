"""The training loop: data -> sharded state -> compiled steps -> logs and checkpoints.

Everything a step needs is a function of (config, step): the batch comes from
`batch_for_step(seed, step)`, dropout from `fold_in(key, step)`, so resuming from a
checkpoint replays exactly what an uninterrupted run would have done.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from ml_collections import ConfigDict
from tqdm import tqdm

from jaxgpt import distributed, sharding
from jaxgpt.checkpoint import Checkpointer
from jaxgpt.data import Dataset, batch_for_step, check_shapes, eval_batches, load_dataset, prepare_builtin
from jaxgpt.errors import UserError
from jaxgpt.flops import flops_per_token, measure_matmul_peak
from jaxgpt.model import dummy_tokens
from jaxgpt.train_config import TrainConfig, resolve


def use_cpu_devices(n: int) -> None:
    """Split this host's CPU into `n` XLA devices, so that the default mesh is data parallel over the cores.

    XLA:CPU runs the ops of one device largely one after another, and the small ones (norms, softmax,
    the attention of a 128-wide model) on a single thread; a second device working on its own half of
    the batch keeps the other core busy. It pays off for small models only (benchmarks/bench_train.py
    times both: +20-25% on 4 x 128, nothing on 6 x 384). Only the CPU backend is affected: on GPUs and
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


def setup_runtime(c: ConfigDict) -> None:
    """CPU devices, persistent compile cache and multi-host initialization: all must precede any computation."""
    use_cpu_devices(c.get("cpu_devices", 0))
    if c.compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(c.compilation_cache_dir))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    distributed.initialize(c.distributed)


def open_dataset(c: ConfigDict) -> Dataset:
    """Load the prepared dataset, preparing a built-in one on first use."""
    data_dir = Path(c.data.dir)
    bpe_file = c.data.bpe_file or None

    def prepare_if_missing() -> None:
        if not (data_dir / "meta.json").exists() and c.data.name:
            if jax.process_index() == 0:
                print(f"preparing dataset {c.data.name} in {data_dir} ...", flush=True)
            prepare_builtin(c.data.name, data_dir, bpe_file=bpe_file)

    if jax.process_count() == 1:
        prepare_if_missing()
    else:  # process 0 first: on a shared filesystem the others then find it ready instead of racing it
        if jax.process_index() == 0:
            prepare_if_missing()
        multihost_utils.sync_global_devices("jaxgpt-dataset-ready")
        prepare_if_missing()  # host-local disks: every host needs its own copy
    return load_dataset(data_dir, bpe_file=bpe_file)


def check_workdir(workdir: str) -> Path:
    path = Path(workdir).absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UserError(f"work directory {path} is not writable ({e.strerror}): choose another "
                        "--config.workdir") from None
    return path


class MetricsLog:
    """metrics.jsonl, TensorBoard events and the console, written by process 0 only."""

    def __init__(self, workdir: Path, resume_step: int) -> None:
        self.enabled = jax.process_index() == 0
        self.path = workdir / "metrics.jsonl"
        if not self.enabled:
            return
        if resume_step and self.path.exists():  # steps after the checkpoint will be logged again, identically
            kept = [line for line in self.path.read_text().splitlines() if json.loads(line)["step"] <= resume_step]
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            tmp.replace(self.path)
        from tensorboardX import SummaryWriter

        self.tb = SummaryWriter(str(workdir / "tensorboard"), purge_step=resume_step or None)

    def write(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")
        for name, value in values.items():
            self.tb.add_scalar(name, value, step)

    def close(self) -> None:
        if self.enabled:
            self.tb.close()


def micro_batches(x: np.ndarray, grad_accum: int) -> np.ndarray:
    """(b, T) local rows -> (A, b/A, T), interleaved so each process's rows stay contiguous per micro-batch."""
    b, T = x.shape
    return x.reshape(b // grad_accum, grad_accum, T).transpose(1, 0, 2)


def train(c: ConfigDict) -> dict[str, Any]:
    """Run (or resume) training as configured; returns the final metrics."""
    setup_runtime(c)
    dataset = open_dataset(c)
    cfg: TrainConfig = resolve(c, dataset.meta["vocab_size"])
    for split in ("train", "val"):  # a block size the data cannot fill fails before anything is written
        check_shapes(len(getattr(dataset, split)), 1, cfg.model.block_size, split)
    workdir = check_workdir(cfg.workdir)
    is_main = jax.process_index() == 0
    mesh = sharding.make_mesh(cfg.mesh)
    prog = distributed.build_program(cfg, mesh)  # the same sharded program that `jaxgpt.aot` compiles for TPUs

    init_key, dropout_key = jax.random.split(jax.random.key(cfg.seed))
    ckpt = Checkpointer(workdir, keep=cfg.keep_checkpoints)
    meta = {"model": cfg.model.to_dict(), "config": json.loads(c.to_json()), "dataset": dataset.meta,
            "tokenizer": dataset.meta["tokenizer"]}
    pretrained = None
    if c.init_from and ckpt.latest_step() is None:  # read outside the mesh context: plain host arrays
        from jaxgpt.init_from import load_initial_params

        pretrained = jax.device_get(load_initial_params(c.init_from, cfg.model))
    with prog.activate():
        state, start = _initial_state(cfg, ckpt, prog, init_key, pretrained)
        if is_main:
            (workdir / "config.json").write_text(json.dumps(meta["config"], indent=2) + "\n")
            n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(state["params"]))
            print(f"model: {n_params:,} parameters; mesh {dict(mesh.shape)}; "
                  f"{'resuming at step ' + str(start) if start else 'starting from step 0'}", flush=True)
        batch_size, T, A = cfg.batch_size, cfg.model.block_size, cfg.grad_accum
        # Each process reads only the rows its devices hold (all of them if the batch is replicated over hosts).
        train_shape, eval_shape = (A, batch_size // A, T), (batch_size // A, T)
        train_rows = distributed.local_rows(prog.batch_sh, train_shape, dim=1)
        eval_rows = distributed.local_rows(prog.eval_sh, eval_shape, dim=0)

        def batch(step: int) -> dict[str, jax.Array]:
            x, y = distributed.read_rows(lambda i, n: batch_for_step(
                dataset.train, seed=cfg.seed, step=step, batch_size=batch_size, block_size=T, process_index=i,
                process_count=n), train_rows, batch_size, unit=A)
            return {k: distributed.global_array(prog.batch_sh, micro_batches(v, A), train_shape)
                    for k, v in (("x", x), ("y", y))}

        def eval_split(split: str) -> list[dict[str, jax.Array]]:
            batches = distributed.read_rows(lambda i, n: eval_batches(
                getattr(dataset, split), batch_size=batch_size // A, block_size=T, n_batches=cfg.eval_batches,
                seed=cfg.seed, split=split, process_index=i, process_count=n), eval_rows, batch_size // A)
            return [{k: distributed.global_array(prog.eval_sh, v, eval_shape) for k, v in zip("xy", xy, strict=True)}
                    for xy in batches]

        evals = {split: eval_split(split) for split in ("train", "val")}

        def evaluate(params: Any) -> dict[str, float]:
            return {f"{split}_loss": float(np.mean(jax.device_get([prog.eval_step(params, b) for b in batches])))
                    for split, batches in evals.items()}

        t0 = time.perf_counter()
        compiled = prog.train_step.lower(state, batch(start), dropout_key).compile()
        compile_s = time.perf_counter() - t0
        log = MetricsLog(workdir, start)
        bar = tqdm(total=cfg.max_steps, initial=start, disable=not is_main, unit="step", dynamic_ncols=True)
        pending: list[tuple[int, dict]] = []
        last_eval: dict[str, float] = {}
        tokens_per_step = batch_size * T
        t_log, n_timed, t_train = time.perf_counter(), 0, 0.0

        def flush(step: int) -> None:
            """Fetch the queued step metrics; stop on a non-finite loss before anything is saved."""
            nonlocal t_log, n_timed, t_train
            if not pending:
                return
            fetched = jax.device_get([m for _, m in pending])
            elapsed = time.perf_counter() - t_log
            t_train += elapsed
            tok_s = tokens_per_step * len(pending) / elapsed
            for (s, _), m in zip(pending, fetched, strict=True):
                if not np.isfinite(m["loss"]):
                    raise UserError(f"loss is {m['loss']} at step {s}: training stopped; the last good checkpoint "
                                    f"(step {ckpt.latest_step()}) is kept. Lower optim.lr or raise optim.warmup_steps")
            n_timed += len(pending)
            last = {k: float(v) for k, v in fetched[-1].items()}
            log.write(step, {"train_loss": last["loss"], "lr": last["lr"], "grad_norm": last["grad_norm"],
                             "tokens_per_sec": tok_s})
            bar.set_postfix(loss=f"{last['loss']:.4f}", lr=f"{last['lr']:.2e}", tok_s=f"{tok_s:,.0f}")
            pending.clear()
            t_log = time.perf_counter()

        try:
            for step in range(start, cfg.max_steps):
                state, metrics = compiled(state, batch(step), dropout_key)
                pending.append((step + 1, metrics))
                bar.update(1)
                done = step + 1
                is_eval = done % cfg.eval_interval == 0 or done == cfg.max_steps
                if done % cfg.log_interval == 0 or is_eval or done % cfg.ckpt_interval == 0:
                    flush(done)
                if is_eval:
                    t_eval = time.perf_counter()
                    last_eval = evaluate(state["params"])
                    log.write(done, last_eval)
                    if is_main:
                        bar.write(f"step {done}: train loss {last_eval['train_loss']:.4f}, "
                                  f"val loss {last_eval['val_loss']:.4f}")
                    t_log += time.perf_counter() - t_eval  # keep evaluation out of tokens/s
                if is_eval or done % cfg.ckpt_interval == 0:
                    ckpt.save(state, {**meta, **({"val_loss": last_eval["val_loss"]} if is_eval else {})})
            flush(cfg.max_steps)
        finally:  # a save in flight must commit even when training stops early, or it is silently lost
            bar.close()
            ckpt.wait()
            ckpt.close()
            log.close()
    summary = _throughput(cfg, n_timed, t_train, compile_s)
    if is_main:
        print(summary["report"], flush=True)
    multihost_utils.sync_global_devices("jaxgpt-train-end")
    return {**last_eval, **summary, "state": state, "model_cfg": cfg.model, "tokenizer_meta": dataset.meta["tokenizer"]}


def _initial_state(cfg: TrainConfig, ckpt: Checkpointer, prog: distributed.Program, key: jax.Array,
                   pretrained: Any = None) -> tuple[dict, int]:
    """Resume from the latest checkpoint, or initialize (from scratch or from `init_from`) directly sharded."""
    latest = ckpt.latest_step()
    if latest is not None:
        if not cfg.resume:
            raise UserError(f"{cfg.workdir} already holds checkpoints (latest step {latest}): pass "
                            "--config.resume=True to continue, or choose a new --config.workdir")
        saved = ckpt.read_meta(latest)["model"]
        if saved != cfg.model.to_dict():
            diff = sorted(k for k in saved if saved[k] != cfg.model.to_dict().get(k))
            raise UserError(f"the checkpoint in {cfg.workdir} was trained with different model settings {diff}: "
                            "use the same model config or a new --config.workdir")
        return ckpt.restore(latest, prog.abstract_state), latest
    state_sh = prog.state_sh
    if pretrained is not None:
        params = jax.device_put(pretrained, state_sh["params"])
    else:
        dummy = dummy_tokens(cfg.model)
        params = jax.jit(lambda k: nn.unbox(prog.model.init(k, dummy)["params"]),
                         out_shardings=state_sh["params"])(key)
    opt_state = jax.jit(prog.tx.init, out_shardings=state_sh["opt_state"])(params)
    return {"params": params, "opt_state": opt_state,
            "step": jax.device_put(jnp.zeros((), jnp.int32), state_sh["step"])}, 0


def _throughput(cfg: TrainConfig, n_steps: int, seconds: float, compile_s: float) -> dict[str, Any]:
    tokens = n_steps * cfg.batch_size * cfg.model.block_size
    tok_s = tokens / seconds if seconds else 0.0
    model_flops = tok_s * flops_per_token(cfg.model)
    # Fake CPU devices share the same cores; accelerators each bring their own peak.
    peak = measure_matmul_peak() * (jax.device_count() if jax.devices()[0].platform != "cpu" else 1)
    report = (f"throughput: {tok_s:,.0f} tokens/s over {n_steps} steps (compile {compile_s:.1f} s); model "
              f"{model_flops / 1e9:,.1f} GFLOP/s = {model_flops / peak:.1%} of the measured matmul peak "
              f"({peak / 1e9:,.0f} GFLOP/s)")
    return {"tokens_per_sec": tok_s, "model_flops_per_sec": model_flops, "mfu_vs_measured_peak": model_flops / peak,
            "compile_seconds": compile_s, "report": report}
