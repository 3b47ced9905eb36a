"""Training end to end: exact resume across SIGKILL, atomic checkpoints, bad input, NaN handling."""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import traverse_util
from helpers import ROOT, logged_eval, logged_losses, logged_records, write_hellaswag_fixture
from helpers.runs import final_params, run_train, train_cmd, train_losses

from jaxgpt.io.checkpoint import Checkpointer
from jaxgpt.train import optim


def test_resume_after_sigkill_is_bitwise_exact(tmp_path: Path, data_dir: Path, xla_cache: str) -> None:
    steps = ["--config.max_steps=300", "--config.ckpt_interval=50", "--config.eval_interval=100",
             "--config.model.resid_dropout=0.1"]  # dropout on: its randomness must resume too
    straight = tmp_path / "straight"
    run_train(*train_cmd(straight, data_dir, xla_cache, *steps))

    killed = tmp_path / "killed"
    proc = subprocess.Popen(train_cmd(killed, data_dir, xla_cache, *steps), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (killed / "checkpoints" / "50").is_dir():
        assert proc.poll() is None and time.time() < deadline, "training ended before the first checkpoint"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = Checkpointer(killed, read_only=True)
    killed_at = before.latest_step()
    before.close()
    assert killed_at is not None and killed_at < 300, "the kill must land mid-run"
    resumed = run_train(*train_cmd(killed, data_dir, xla_cache, *steps))
    assert f"resuming at step {killed_at}" in resumed.stdout

    want, got = final_params(straight), final_params(killed)
    assert want.keys() == got.keys()
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=str(k))
    assert train_losses(killed) == train_losses(straight)


def test_kill_during_checkpoint_save_keeps_previous(tmp_path: Path) -> None:
    """A process SIGKILLed while an asynchronous save is in flight leaves the previous step restorable."""
    script = f"""
import os, signal, numpy as np, jax.numpy as jnp
from jaxgpt.io.checkpoint import Checkpointer
ck = Checkpointer({str(tmp_path)!r})
small = {{"params": {{"w": jnp.ones((4, 4))}}, "opt_state": {{"m": jnp.zeros((4,))}}, "step": jnp.asarray(1)}}
ck.save(small, {{"model": {{}}}}); ck.wait()
big = {{"params": {{"w": jnp.ones((8192, 8192))}}, "opt_state": {{"m": jnp.ones((8192, 8192))}},
       "step": jnp.asarray(2)}}
ck.save(big, {{"model": {{}}}})
os.kill(os.getpid(), signal.SIGKILL)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120, cwd=ROOT)
    assert proc.returncode == -signal.SIGKILL
    ckpt = Checkpointer(tmp_path, read_only=True)
    assert ckpt.manager.all_steps() == [1]
    restored = ckpt.manager.restore(1, args=ocp.args.Composite(params=ocp.args.StandardRestore()))
    np.testing.assert_array_equal(restored["params"]["w"], np.ones((4, 4)))


def test_keeps_last_n_plus_best(tmp_path: Path) -> None:
    import jax.numpy as jnp

    ckpt = Checkpointer(tmp_path, keep=2)
    for step, val in [(1, 3.0), (2, 1.0), (3, 2.0), (4, None), (5, 2.5)]:
        state = {"params": {"w": jnp.full((2,), step)}, "opt_state": {"m": jnp.zeros(1)}, "step": jnp.asarray(step)}
        ckpt.save(state, {"model": {}, **({"val_loss": val} if val is not None else {})})
        ckpt.wait()
    assert ckpt.manager.all_steps() == [2, 4, 5]
    assert ckpt.best_step() == 2 and ckpt.latest_step() == 5
    ckpt.close()


def test_wall_clock_cadence_saves_between_step_checkpoints(tmp_path: Path, data_dir: Path) -> None:
    from helpers import load_tiny, train_run

    c = load_tiny(workdir=str(tmp_path / "run"), data_dir=str(data_dir), max_steps=20, eval_interval=20,
                  ckpt_interval=1000, keep_checkpoints=100, ckpt_minutes=1e-9)  # due after every step
    train_run(c)
    assert Checkpointer(tmp_path / "run", read_only=True).all_steps() == list(range(1, 21))
    c = load_tiny(workdir=str(tmp_path / "steps"), data_dir=str(data_dir), max_steps=20, eval_interval=20,
                  ckpt_interval=1000, keep_checkpoints=100)
    train_run(c)
    assert Checkpointer(tmp_path / "steps", read_only=True).all_steps() == [20]  # the step cadence alone


def test_train_in_process_learns_and_writes_outputs(tmp_path: Path, data_dir: Path) -> None:
    from helpers import load_tiny, train_run

    c = load_tiny(workdir=str(tmp_path / "run"), data_dir=str(data_dir), max_steps=60, eval_interval=30,
                  tensorboard=True)
    out = train_run(c)
    rows = logged_records(tmp_path / "run")
    evals = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in evals] == [30, 60]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] < np.log(out["state"]["params"]["wte"]["embedding"].shape[0])
    assert list((tmp_path / "run" / "tensorboard").iterdir())
    assert json.loads((tmp_path / "run" / "config.json").read_text())["max_steps"] == 60
    assert out["tokens_per_sec"] > 0 and 0 < out["mfu"] < 1


def test_gradient_accumulation_equals_one_big_batch(tmp_path: Path, data_dir: Path) -> None:
    """With AdamW's eps at 1 (far above these gradients) and no clipping, an update is about lr times the
    gradient, so the parameters show the gradient's scale: four micro-batches summed, not averaged, put them
    3e-3 apart (3e4 times the tolerance; rounding: 4e-9). At the usual eps, Adam divides the scale out (that bug
    went unseen) and magnifies the rounding of gradients that nearly cancel (4.6e-5 on Python 3.13's corpus)."""
    from helpers import load_tiny, train_run

    runs = {}
    for accum in (1, 4):
        c = load_tiny(workdir=str(tmp_path / f"a{accum}"), data_dir=str(data_dir), max_steps=5, eval_interval=5,
                      grad_accum=accum)
        c.optim.warmup_steps, c.optim.eps, c.optim.grad_clip = 1, 1.0, 0.0
        runs[accum] = train_run(c)["state"]["params"]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-7), runs[1], runs[4])


@pytest.mark.parametrize("accum", [1, 2])
def test_one_micro_batch_steps_without_a_loop(data_dir: Path, accum: int) -> None:
    """A loop on a GPU costs a host round trip per trip: the step of one micro-batch (dense loss, unscanned
    layers) has none; accumulating over two keeps its scan."""
    from helpers import load_tiny

    from jaxgpt.data.dataset import load_dataset
    from jaxgpt.tasks.lm import LanguageModelling
    from jaxgpt.train.config import from_config_dict
    from jaxgpt.train.step import make_train_step

    cfg = from_config_dict(load_tiny(workdir="unused", data_dir=str(data_dir), loss_chunk=0))
    task, tx = LanguageModelling(cfg, load_dataset(data_dir)), optim.make_optimizer(cfg.optim)
    params = jax.eval_shape(lambda: task.model.init(jax.random.key(0), *task.example_inputs())["params"])
    state = {"params": params, "opt_state": jax.eval_shape(tx.init, params), "step": jax.ShapeDtypeStruct((), np.int32)}
    rows = jax.ShapeDtypeStruct((accum, 2, task.model_cfg.block_size), np.int32)
    hlo = jax.jit(make_train_step(task.loss, tx)).lower(state, {"x": rows, "y": rows}, jax.random.key(1)).as_text()
    assert ("stablehlo.while" in hlo) == (accum > 1)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--config.optim.lrr=1"], "lrr"),
        (["--config.model.resid_dropout=1.5"], "resid_dropout"),
        (["--config.optim.lr=-1"], "optim.lr"),
        (["--config.model.n_head=3"], "not divisible"),
        (["--config.model.block_size=100000", "--config.model.position=sinusoidal"], "larger than"),
        (["--config.batch_size=6", "--config.grad_accum=4"], "grad_accum"),
        (["--config.model.vocab_size=10"], "vocab"),
        (["--config.cpu_devices=-1"], "cpu_devices"),
    ],
)
def test_bad_config_is_one_line_error(tmp_path: Path, data_dir: Path, xla_cache: str, extra: list[str],
                                      message: str) -> None:
    proc = run_train(*train_cmd(tmp_path / "w", data_dir, xla_cache, *extra), check=False)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and message in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "w" / "checkpoints").exists()


def test_cpu_devices_train_data_parallel_like_one_device(tmp_path: Path, data_dir: Path, xla_cache: str) -> None:
    """config.cpu_devices=2 splits the CPU into two devices, the default mesh puts half of each batch on each,
    and the run computes what the one-device run does (up to summation order); the sample after training works."""
    one = run_train(*train_cmd(tmp_path / "one", data_dir, xla_cache, "--config.max_steps=20"))
    two = run_train(*train_cmd(tmp_path / "two", data_dir, xla_cache, "--config.max_steps=20", "--config.cpu_devices=2",
                               "--config.sample.max_new_tokens=8"))
    assert "mesh {'data': 1," in one.stdout and "mesh {'data': 2," in two.stdout
    losses_one, losses_two = logged_losses(tmp_path / "one"), logged_losses(tmp_path / "two")
    assert [s for s, _ in losses_one] == [s for s, _ in losses_two]
    np.testing.assert_allclose([v for _, v in losses_two], [v for _, v in losses_one], rtol=1e-5)
    assert "--- sample" in two.stdout


def test_cpu_devices_after_jax_started_is_a_user_error() -> None:
    from jaxgpt.errors import UserError
    from jaxgpt.train.runtime import use_cpu_devices

    jax.devices()  # this process's CPU backend is running with one device
    use_cpu_devices(len(jax.devices("cpu")))  # asking for what is there is fine
    with pytest.raises(UserError, match="before any JAX computation"):
        use_cpu_devices(len(jax.devices("cpu")) + 1)


def test_bad_data_and_workdir_are_one_line_errors(tmp_path: Path, data_dir: Path, xla_cache: str) -> None:
    missing = run_train(*train_cmd(tmp_path / "w", tmp_path / "nodata", xla_cache), check=False)
    assert missing.returncode == 2 and "error:" in missing.stderr and "Traceback" not in missing.stderr

    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    for f in data_dir.iterdir():
        (corrupt / f.name).write_bytes(f.read_bytes())
    with (corrupt / "tokens_000000.bin").open("r+b") as f:
        f.write(b"\xff\xff")
    bad = run_train(*train_cmd(tmp_path / "w", corrupt, xla_cache), check=False)
    assert bad.returncode == 2 and "tokens_000000.bin" in bad.stderr and "Traceback" not in bad.stderr

    blocker = tmp_path / "a-file"
    blocker.write_text("a file where the work directory should go")
    ro = run_train(*train_cmd(blocker / "run", data_dir, xla_cache), check=False)
    assert ro.returncode == 2 and "not writable" in ro.stderr and "Traceback" not in ro.stderr


def test_existing_run_is_not_overwritten_without_resume(tmp_path: Path, data_dir: Path, xla_cache: str) -> None:
    run_train(*train_cmd(tmp_path / "w", data_dir, xla_cache, "--config.max_steps=20"))
    proc = run_train(*train_cmd(tmp_path / "w", data_dir, xla_cache, "--config.resume=False"), check=False)
    assert proc.returncode == 2 and "already holds checkpoints" in proc.stderr
    changed = run_train(*train_cmd(tmp_path / "w", data_dir, xla_cache, "--config.model.n_layer=3"), check=False)
    assert changed.returncode == 2 and "n_layer" in changed.stderr
    assert Checkpointer(tmp_path / "w", read_only=True).latest_step() == 20


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path: Path, data_dir: Path, xla_cache: str) -> None:
    proc = run_train(*train_cmd(tmp_path / "w", data_dir, xla_cache, "--config.optim.lr=1e9",
                                "--config.optim.min_lr=0", "--config.optim.grad_clip=0",
                                "--config.optim.warmup_steps=0", "--config.ckpt_interval=1",
                                "--config.log_interval=1"), check=False)
    assert proc.returncode == 2 and "loss is nan" in proc.stderr.lower(), proc.stderr[-2000:]
    ckpt = Checkpointer(tmp_path / "w", read_only=True)
    step = ckpt.latest_step()
    assert step is not None
    rows = logged_records(tmp_path / "w")
    assert all(np.isfinite(r["train_loss"]) for r in rows if r["step"] <= step)


FAULTS_PER_256MB = """
import ctypes, resource
from jaxgpt.commands import use_huge_pages
use_huge_pages()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
ctypes.memset(libc.malloc(256 << 20), 1, 256 << 20)  # glibc maps a block this large fresh from the kernel
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="a glibc tunable")
def test_commands_restart_with_huge_page_malloc() -> None:
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("transparent huge pages are off in this kernel")

    def page_faults(**env: str) -> int:
        env = {**{k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "JAXGPT_HUGE_PAGES")}, **env}
        proc = subprocess.run([sys.executable, "-c", FAULTS_PER_256MB], capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stderr
        return int(proc.stdout)

    small_pages = page_faults(JAXGPT_HUGE_PAGES="0")
    assert small_pages > 50_000  # one per 4 KiB page
    assert page_faults() < small_pages / 20
    assert page_faults(GLIBC_TUNABLES="glibc.malloc.arena_max=4") < small_pages / 20  # added to the user's own


def test_weight_decay_mask_is_by_name_even_when_scanned() -> None:
    from jaxgpt.model.config import ModelConfig
    from jaxgpt.model.gpt import init_params

    params = init_params(ModelConfig(scan_layers=True, tie_embeddings=False), jax.random.key(0))
    mask = traverse_util.flatten_dict(optim.decay_mask(params))
    decayed = sorted("/".join(k) for k, v in mask.items() if v)
    assert decayed == ["h/attn/out/kernel", "h/attn/qkv/kernel", "h/mlp/fc/kernel", "h/mlp/proj/kernel",
                       "lm_head/kernel"]


def test_schedule_warms_up_then_decays_to_min() -> None:
    sched = optim.schedule(optim.OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, decay_steps=100))
    assert float(sched(0)) == pytest.approx(1e-4) and float(sched(10)) == pytest.approx(1e-3)
    assert float(sched(100)) == pytest.approx(1e-4) and float(sched(1000)) == pytest.approx(1e-4)
    assert float(sched(55)) == pytest.approx(5.5e-4, rel=1e-3)


def test_init_from_workdir_and_hf_start_from_those_weights(tmp_path: Path, data_dir: Path) -> None:
    from helpers import load_tiny, train_run

    from jaxgpt.io.hf import save_hf
    from jaxgpt.io.weights import load_for

    first = train_run(load_tiny(workdir=str(tmp_path / "first"), data_dir=str(data_dir), max_steps=20))
    cfg, params = first["model_cfg"], first["state"]["params"]
    save_hf(params, cfg, tmp_path / "hf")
    for spec in (f"workdir:{tmp_path / 'first'}", f"hf:{tmp_path / 'hf'}"):
        loaded = load_for(spec, cfg.replace(scan_layers=True)).params
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a)[0], np.asarray(b)),
                     loaded["h"], params["h_0"])
    c = load_tiny(workdir=str(tmp_path / "second"), data_dir=str(data_dir), max_steps=1, eval_interval=1)
    c.init_from = f"workdir:{tmp_path / 'first'}"
    second = train_run(c)
    assert second["val_loss"] < first["val_loss"] + 0.05  # starts where the first run ended, not from scratch
    with pytest.raises(Exception, match="different architecture"):
        load_for(f"workdir:{tmp_path / 'first'}", cfg.replace(n_layer=3))


def test_hellaswag_during_training_equals_the_eval_of_its_checkpoint(tmp_path: Path, data_dir: Path,
                                                                    xla_cache: str) -> None:
    """`eval.hellaswag` scores the run's own sharded parameters (rows split over two devices) at each evaluation
    and logs eval/hellaswag_acc_norm; its numbers equal the one-device evaluation of the checkpoint saved there."""
    from jaxgpt.evals import benchmarks
    from jaxgpt.io import weights

    path = write_hellaswag_fixture(tmp_path / "hellaswag_val.jsonl", 12)
    workdir = tmp_path / "run"
    proc = run_train(*train_cmd(workdir, data_dir, xla_cache, "--config.max_steps=20",
                                "--config.cpu_devices=2", "--config.eval.hellaswag=True",
                                f"--config.eval.hellaswag_data={path}"))
    assert "mesh {'data': 2," in proc.stdout and "hellaswag acc_norm" in proc.stdout
    acc, acc_norm = logged_eval(workdir, "hellaswag_acc"), logged_eval(workdir, "hellaswag_acc_norm")
    assert [step for step, _ in acc_norm] == [20]

    loaded = weights.load(f"workdir:{workdir}")
    alone = benchmarks.evaluate("hellaswag", loaded.params, loaded.model, loaded.tokenizer(), path, batch_size=4,
                                progress=False)
    assert (acc[0][1], acc_norm[0][1]) == (alone.accuracy, alone.accuracy_norm)


def test_hellaswag_during_training_is_for_language_models() -> None:
    from jaxgpt.errors import UserError
    from jaxgpt.train.config import EvalConfig, TrainConfig

    with pytest.raises(UserError, match=r"eval\.hellaswag scores a language model"):
        TrainConfig(workdir="w", task="classify", eval=EvalConfig(hellaswag=True))
