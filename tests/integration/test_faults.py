"""Faults a hostile user or environment brings, each as a real command in a subprocess.

The promise under test: a mistake or a fault ends as one `error: ...` line on stderr (status 2, or 128 +
the signal for a run stopped by SIGINT / SIGTERM), never a traceback, and a refused command changes no
file that was there before (checked by sha256 of every file in the work, dataset and output directories).

A full disk is simulated with RLIMIT_FSIZE in the child (`ulimit -f`: portable, no root or tmpfs needed):
writes past the limit fail with EFBIG (Python ignores SIGXFSZ, so the signal never kills the process),
which takes the same path as ENOSPC through every handler.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT, TINY, logged_records, one_line_error
from helpers.runs import run

from jaxgpt.io.checkpoint import Checkpointer

# An explicit decay: changing max_steps then leaves the schedule (and so the run's trajectory) unchanged.
FIXED = ["--config.optim.decay_steps=1000"]
# Bytes per file: more than a log or a config file needs (5 KB), less than any file a checkpoint of the tiny model
# writes its kernels into (each 16 KiB, of which 12 among the parameters and Adam's moments). Tensorstore groups a
# save's arrays into data files as its writes happen to flush, so a limit between one array and a checkpoint's
# total (64 KiB, before) failed only when some file happened to hold enough of them.
LIMIT = 8 * 1024
def train_cmd(workdir: Path, data_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), f"--config={TINY}", f"--config.workdir={workdir}",
            f"--config.data.dir={data_dir}", *FIXED, *extra]  # conftest's compile cache: the tiny model compiles once


def data_cmd(*extra: str) -> list[str]:
    return [sys.executable, "-m", "jaxgpt", "data", *extra]


def limited(cmd: list[str]) -> list[str]:
    """`cmd` under RLIMIT_FSIZE (set by the shell: a preexec_fn would fork this multithreaded process)."""
    return ["bash", "-c", f'ulimit -f {LIMIT // 1024} && exec "$@"', "bash", *cmd]


def checksums(*dirs: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for d in dirs if d.exists() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, data_dir: Path, xla_cache: str) -> Path:
    """A finished 20-step run with checkpoints at steps 10 and 20 (copied by the tests that change it)."""
    workdir = tmp_path_factory.mktemp("trained") / "run"
    proc = run(train_cmd(workdir, data_dir, "--config.max_steps=20", "--config.ckpt_interval=10",
                         "--config.eval_interval=10"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir


@pytest.fixture
def run_copy(trained: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


# ---------------------------------------------------------------------------------- the work directory


def test_foreign_config_json_is_refused(tmp_path: Path, data_dir: Path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    (hf / "model.safetensors").write_bytes(b"\0" * 64)
    before = checksums(hf)
    assert "did not write" in one_line_error(run(train_cmd(hf, data_dir)))
    assert checksums(hf) == before and sorted(p.name for p in hf.iterdir()) == ["config.json", "model.safetensors"]


def test_directory_of_other_files_is_refused(tmp_path: Path, data_dir: Path) -> None:
    other = tmp_path / "notes"
    other.mkdir()
    (other / "thesis.tex").write_text("months of work")
    before = checksums(other)
    assert "thesis.tex" in one_line_error(run(train_cmd(other, data_dir)))
    assert checksums(other) == before


def test_second_trainer_fails_at_once_naming_the_holder(run_copy: Path, data_dir: Path) -> None:
    from jaxgpt.train.rundir import WorkdirLock

    lock = WorkdirLock(run_copy)  # this process plays the first trainer
    lock.record_holder()
    try:
        before = checksums(run_copy)
        started = time.time()
        line = one_line_error(run(train_cmd(run_copy, data_dir, "--config.max_steps=30")))
        assert f"PID {os.getpid()}" in line and "in use" in line and time.time() - started < 60
        assert checksums(run_copy) == before
    finally:
        lock.release()


def test_stale_lock_of_a_dead_process_is_taken_over(run_copy: Path, data_dir: Path) -> None:
    (run_copy / "jaxgpt.lock").write_text("999999\n")  # a PID file without a live flock behind it
    proc = run(train_cmd(run_copy, data_dir, "--config.max_steps=25"))
    assert proc.returncode == 0 and "resuming at step 20" in proc.stdout, proc.stderr[-3000:]


# ----------------------------------------------------------------------------------------- signals


def start_long_run(workdir: Path, data_dir: Path) -> subprocess.Popen:
    return subprocess.Popen(train_cmd(workdir, data_dir, "--config.max_steps=100000", "--config.ckpt_interval=20",
                                      "--config.eval_interval=100000"),
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_for_line(proc: subprocess.Popen, needle: str, seen: list[str]) -> None:
    for line in proc.stderr:
        seen.append(line)
        if needle in line:
            return
    raise AssertionError("".join(seen)[-3000:])


def test_signal_saves_a_checkpoint_and_exits_with_one_line(tmp_path: Path, data_dir: Path) -> None:
    """SIGTERM (a scheduler's, a preemption's); SIGINT takes the same handler (`train.interrupt.SIGNALS`), and the
    next test sends it."""
    workdir, sig = tmp_path / "run", signal.SIGTERM
    proc, seen = start_long_run(workdir, data_dir), []
    wait_for_line(proc, "step 25/", seen)  # training, between checkpoints
    proc.send_signal(sig)
    err = "".join(seen) + proc.stderr.read()
    assert proc.wait(timeout=120) == 128 + sig and "Traceback" not in err, err[-3000:]
    line = next(li for li in err.splitlines() if li.startswith("error: "))
    stopped_at = int(line.split(" at step ")[1].split(";")[0])
    assert stopped_at > 20 and f"stopped by {signal.Signals(sig).name}" in line
    assert Checkpointer(workdir, read_only=True).latest_step() == stopped_at  # the steps since 20 are kept
    resumed = run(train_cmd(workdir, data_dir, f"--config.max_steps={stopped_at + 5}"))
    assert resumed.returncode == 0 and f"resuming at step {stopped_at}" in resumed.stdout, resumed.stderr[-2000:]


def test_second_sigint_exits_at_once_and_keeps_the_checkpoint(tmp_path: Path, data_dir: Path) -> None:
    workdir = tmp_path / "run"
    proc, seen = start_long_run(workdir, data_dir), []
    wait_for_line(proc, "step 45/", seen)  # the checkpoint of step 20 (and maybe 40) exists
    proc.send_signal(signal.SIGINT)
    wait_for_line(proc, "stopping after this step", seen)
    proc.send_signal(signal.SIGINT)
    proc.stderr.read()
    assert proc.wait(timeout=120) in (-signal.SIGINT, 130)
    ckpt = Checkpointer(workdir, read_only=True)
    step = ckpt.latest_step()
    assert step is not None and step >= 20
    ckpt.read_meta(step)
    assert ckpt.restore_params(step)  # intact: orbax renames a checkpoint into place only when complete


# ------------------------------------------------------------------------------------------ datasets


def test_data_refuses_a_different_existing_dataset(tmp_path: Path, data_dir: Path) -> None:
    out = tmp_path / "ds"
    shutil.copytree(data_dir, out)
    text = tmp_path / "t.txt"
    text.write_text("something else entirely, " * 400)
    before = checksums(out)
    assert "--overwrite" in one_line_error(run(data_cmd("--text", str(text), "--out", str(out))))
    assert checksums(out) == before
    proc = run(data_cmd("--text", str(text), "--out", str(out), "--overwrite"))
    assert proc.returncode == 0 and checksums(out) != before, proc.stderr


def test_data_leaves_the_same_dataset_untouched(tmp_path: Path) -> None:
    text, out = tmp_path / "t.txt", tmp_path / "ds"
    text.write_text("the same text, " * 400)
    assert run(data_cmd("--text", str(text), "--out", str(out))).returncode == 0
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert run(data_cmd("--text", str(text), "--out", str(out))).returncode == 0
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_own_token_files_without_meta_are_not_overwritten(tmp_path: Path) -> None:
    out = tmp_path / "stdlib_char"
    out.mkdir()
    for name in ("train.bin", "val.bin"):
        (out / name).write_bytes(np.arange(500, dtype="<u2").tobytes())
    before = checksums(out)
    text = tmp_path / "t.txt"
    text.write_text("x y z " * 300)
    assert "without a meta.json" in one_line_error(run(data_cmd("--text", str(text), "--out", str(out))))
    # A config that keeps the built-in data.name does not prepare the built-in over them either.
    proc = run(train_cmd(tmp_path / "w", out, "--config.data.name=stdlib_char"))
    assert "without a meta.json" in one_line_error(proc)
    assert checksums(out) == before


def test_full_disk_during_preparation_leaves_nothing_prepared(tmp_path: Path) -> None:
    text, out = tmp_path / "t.txt", tmp_path / "ds"
    text.write_text("abcdefghij" * 20_000)  # 400 KB of uint16 tokens: past the file-size limit
    line = one_line_error(run(limited(data_cmd("--text", str(text), "--out", str(out)))))
    assert str(out) in line and "MiB" in line
    # Nothing that looks prepared; the workspace keeps completed shards for the next run to resume from.
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == [".ds.preparing", "t.txt"]


def test_unwritable_output_directory_is_one_line(tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text("abc " * 300)
    assert "output directory" in one_line_error(run(data_cmd("--text", str(text), "--out", "/proc/jaxgpt-ds")))


def test_meta_vocabulary_that_disagrees_with_the_tokens_is_refused(tmp_path: Path, data_dir: Path) -> None:
    for how, message in [("smaller", "beyond the vocabulary"), ("inconsistent", "disagrees with itself")]:
        bad = tmp_path / how
        shutil.copytree(data_dir, bad)
        meta = json.loads((bad / "meta.json").read_text())
        meta["vocab_size"] = 10
        if how == "smaller":
            meta["tokenizer"] = {**meta["tokenizer"], "chars": meta["tokenizer"]["chars"][:10], "vocab_size": 10}
        (bad / "meta.json").write_text(json.dumps(meta))
        before = checksums(bad)
        assert message in one_line_error(run(train_cmd(tmp_path / f"w-{how}", bad)))
        assert checksums(bad) == before


# ------------------------------------------------------------------------------ corrupt checkpoints


def corrupt(workdir: Path, step: int) -> None:
    """Truncate every data file of a checkpoint's parameters, as a crashed copy or a bad disk would."""
    for f in (workdir / "checkpoints" / str(step) / "params").rglob("*"):
        if f.is_file() and f.stat().st_size > 64:
            f.write_bytes(f.read_bytes()[:32])


def test_corrupt_checkpoint_is_reported_by_step_with_the_fix(run_copy: Path, data_dir: Path) -> None:
    corrupt(run_copy, 20)
    before = checksums(run_copy)
    line = one_line_error(run(train_cmd(run_copy, data_dir, "--config.max_steps=30")))
    assert "checkpoint step 20" in line and "resume_fallback" in line
    assert checksums(run_copy) == before


def test_resume_fallback_uses_the_newest_readable_checkpoint(run_copy: Path, data_dir: Path) -> None:
    corrupt(run_copy, 20)
    proc = run(train_cmd(run_copy, data_dir, "--config.max_steps=30", "--config.resume_fallback=True"))
    assert proc.returncode == 0 and "resuming at step 10" in proc.stdout, proc.stderr[-3000:]
    assert (run_copy / "corrupt-checkpoints" / "20").is_dir()
    assert Checkpointer(run_copy, read_only=True).all_steps()[-1] == 30


def test_sampling_a_corrupt_checkpoint_is_one_line(run_copy: Path) -> None:
    corrupt(run_copy, 20)
    proc = run([sys.executable, str(ROOT / "sample.py"), f"--workdir={run_copy}", "--max_new_tokens=4"])
    assert "checkpoint step 20" in one_line_error(proc)
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-3000:]  # not the reads still in flight


def scramble_largest(workdir: Path, step: int) -> Path:
    """Overwrite the largest parameter file of a checkpoint with random bytes of its size (a bad disk or copy
    whose sizes still look right): its array fails to decode while the reads of the others are in flight."""
    largest = max((f for f in (workdir / "checkpoints" / str(step) / "params").rglob("*") if f.is_file()),
                  key=lambda f: f.stat().st_size)
    largest.write_bytes(np.random.default_rng(0).bytes(largest.stat().st_size))
    return largest


# `jaxgpt sample` with every array read that succeeds held back a moment, as reads of a large model are: the read
# of the scrambled array fails while all the others are still pending, on any machine.
SLOW_READS = """
import asyncio, sys
from orbax.checkpoint._src.serialization import serialization
read = serialization._read_shard
async def slow(*args, **kwargs):
    shard = await read(*args, **kwargs)
    await asyncio.sleep(2)
    return shard
serialization._read_shard = slow
from jaxgpt.commands.sample import main
sys.exit(main(sys.argv))
"""


@pytest.mark.parametrize("reads", ["as they come", "held back"])
def test_sampling_a_checkpoint_of_random_bytes_is_one_line(run_copy: Path, reads: str) -> None:
    scramble_largest(run_copy, 20)
    command = [sys.executable, str(ROOT / "sample.py")] if reads == "as they come" else [sys.executable, "-c",
                                                                                        SLOW_READS]
    proc = run([*command, f"--workdir={run_copy}", "--max_new_tokens=4"])
    line = one_line_error(proc)
    assert "checkpoint step 20" in line and str(run_copy / "checkpoints") in line
    assert [li for li in proc.stderr.splitlines() if li.strip()] == [line], proc.stderr[-3000:]


def test_deleted_checkpoint_files_are_reported(run_copy: Path, data_dir: Path) -> None:
    shutil.rmtree(run_copy / "checkpoints" / "20" / "opt_state")
    assert "checkpoint step 20" in one_line_error(run(train_cmd(run_copy, data_dir, "--config.max_steps=30")))


# -------------------------------------------------------------------------------------- full disks


def test_full_disk_during_training_keeps_the_previous_checkpoint(run_copy: Path, data_dir: Path) -> None:
    proc = run(limited(train_cmd(run_copy, data_dir, "--config.max_steps=30", "--config.ckpt_interval=10",
                                 "--config.compilation_cache_dir=")))  # no cache writes under the limit
    line = one_line_error(proc)
    assert str(run_copy / "checkpoints") in line and "MiB" in line and "step 20 is intact" in line
    assert len(proc.stderr.splitlines()) < 20, proc.stderr[-3000:]
    ckpt = Checkpointer(run_copy, read_only=True)
    assert ckpt.latest_step() == 20 and ckpt.restore_params(20)


def test_too_little_space_is_refused_before_compiling(tmp_path: Path, data_dir: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from helpers import load_tiny, train_run

    from jaxgpt import storage
    from jaxgpt.errors import UserError

    monkeypatch.setattr(storage, "free_bytes", lambda path: 1000)
    with pytest.raises(UserError, match="MiB free, but a checkpoint of this run needs"):
        train_run(load_tiny(workdir=str(tmp_path / "w"), data_dir=str(data_dir)))
    assert not list((tmp_path / "w" / "checkpoints").iterdir())


# ---------------------------------------------------------------------------- validated up front


@pytest.mark.parametrize(("flag", "message"), [
    ("--config.optim.lr=nan", "optim.lr=nan"),
    ("--config.optim.weight_decay=inf", "optim.weight_decay=inf"),
    ("--config.optim.eps=0", "optim.eps"),
    ("--config.optim.b2=nan", "optim.b2=nan"),
    ("--config.optim.grad_clip=-inf", "grad_clip"),
    (f"--config.sample.max_new_tokens={2**40}", "max_new_tokens"),
    ("--config.sample.top_p=0", "top_p"),
    ("--config.seed=-1", "seed"),
])
def test_bad_numbers_are_refused_before_anything_runs(tmp_path: Path, data_dir: Path, flag: str,
                                                      message: str) -> None:
    assert message in one_line_error(run(train_cmd(tmp_path / "w", data_dir, flag)))
    assert not (tmp_path / "w").exists()


# -------------------------------------------------------------------------------------------- resume


def test_changed_schedule_on_resume_is_refused_with_nothing_written(run_copy: Path, data_dir: Path) -> None:
    before = checksums(run_copy)
    line = one_line_error(run(train_cmd(run_copy, data_dir, "--config.max_steps=30", "--config.optim.lr=0.01",
                                        "--config.batch_size=4")))
    assert "optim.lr" in line and "batch_size" in line and "resume_changes" in line
    assert checksums(run_copy) == before
    proc = run(train_cmd(run_copy, data_dir, "--config.max_steps=30", "--config.optim.lr=0.01",
                         "--config.resume_changes=True"))
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_model_setting_added_after_a_run_was_saved_counts_as_its_default() -> None:
    from jaxgpt.train.resume import changed_keys

    now = {"model.n_layer": 2, "model.attn_resid_dropout": True, "optim.lr": 0.001}
    older = {"model.n_layer": 2, "optim.lr": 0.001}  # saved before attn_resid_dropout existed
    assert changed_keys(older, now) == []
    assert changed_keys(older, {**now, "model.attn_resid_dropout": False}) == ["model.attn_resid_dropout"]
    assert changed_keys({**older, "seed": 1}, now) == ["seed"]  # only model and optim keys have a default to assume


def test_resume_on_a_different_dataset_of_the_same_vocabulary_is_refused(run_copy: Path, data_dir: Path,
                                                                          tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(data_dir, other)
    meta = json.loads((other / "meta.json").read_text())
    tokens = np.fromfile(other / "tokens_000000.bin", dtype="<u2")[::-1].copy()  # same vocabulary, other order
    tokens.tofile(other / "tokens_000000.bin")
    meta["shards"][0]["sha256"] = hashlib.sha256(tokens.tobytes()).hexdigest()
    (other / "meta.json").write_text(json.dumps(meta))
    before = checksums(run_copy)
    assert "data.shards" in one_line_error(run(train_cmd(run_copy, other, "--config.max_steps=30")))
    assert checksums(run_copy) == before


def test_resuming_a_finished_run_says_so(run_copy: Path, data_dir: Path) -> None:
    before = checksums(run_copy)
    proc = run(train_cmd(run_copy, data_dir, "--config.max_steps=20", "--config.sample.max_new_tokens=5"))
    assert proc.returncode == 0 and "already trained to step 20" in proc.stdout, proc.stderr[-2000:]
    assert "tokens/s" not in proc.stdout + proc.stderr and "--- sample" not in proc.stdout
    assert checksums(run_copy) == before


def test_rerun_after_a_kill_before_the_first_checkpoint_drops_the_dead_rows(tmp_path: Path, data_dir: Path) -> None:
    workdir = tmp_path / "w"
    workdir.mkdir()
    dead = [{"step": s, "train_loss": 99.0, "lr": 0.1} for s in (5, 10, 15)]
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in dead) + '{"step": 20, "tr')
    assert run(train_cmd(workdir, data_dir, "--config.max_steps=10")).returncode == 0
    rows = logged_records(workdir)
    assert [r["step"] for r in rows if "lr" in r] == [5, 10] and all(r["train_loss"] != 99.0 for r in rows)


def test_every_start_keeps_its_resolved_config(run_copy: Path, data_dir: Path) -> None:
    assert run(train_cmd(run_copy, data_dir, "--config.max_steps=25", "--config.log_interval=1")).returncode == 0
    starts = sorted((run_copy / "starts").iterdir())
    assert [json.loads(p.read_text())["log_interval"] for p in starts] == [5, 1]
    assert json.loads((run_copy / "config.json").read_text())["max_steps"] == 25


# ------------------------------------------------------------------------------------------------ logs


def tensorboard_tags(directory: Path) -> set[str]:
    """Scalar tags in the TFRecord event files (framing: length, crc, Event proto, crc)."""
    from tensorboardX.proto import event_pb2

    tags = set()
    for path in directory.iterdir():
        data = path.read_bytes()
        while data:
            (n,) = struct.unpack("<Q", data[:8])
            event = event_pb2.Event.FromString(data[12:12 + n])
            tags |= {v.tag for v in event.summary.value}
            data = data[16 + n:]
    return tags


def test_logs_for_batch_jobs_and_humans(tmp_path: Path, data_dir: Path) -> None:
    workdir = tmp_path / "w"
    proc = subprocess.run(train_cmd(workdir, data_dir, "--config.max_steps=20", "--config.eval_interval=10",
                                    "--config.tensorboard=True"),
                          capture_output=True, timeout=300, cwd=ROOT)  # bytes: text mode would turn \r into \n
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert b"\r" not in proc.stderr
    lines = [line for line in proc.stderr.decode().splitlines() if line.startswith("step ")]
    assert [line.split("/")[0] for line in lines] == ["step 5", "step 10", "step 15", "step 20"]
    assert all(k in lines[0] for k in ("loss", "lr", "tokens/s", "elapsed"))
    out = proc.stdout.decode()
    assert all(f"{command} --" in out for command in ("jaxgpt sample", "jaxgpt plots curves", "tensorboard"))
    rows = logged_records(workdir)
    assert all(isinstance(r["time"], float) for r in rows)
    assert {"train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s", "eval/train_loss",
            "eval/val_loss"} <= tensorboard_tags(workdir / "tensorboard")


def test_wandb_is_used_when_asked_and_refused_when_missing(tmp_path: Path, data_dir: Path) -> None:
    assert "pip install wandb" in one_line_error(run(train_cmd(tmp_path / "w", data_dir,
                                                                 "--config.wandb.project=p")))
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "wandb.py").write_text(
        "import json, os\nclass _Run:\n    def log(self, values, step):\n"
        "        open(os.environ['WANDB_LOG'], 'a').write(json.dumps([step, values]) + '\\n')\n"
        "    def finish(self):\n        pass\ndef init(**kwargs):\n    return _Run()\n")
    env = {**os.environ, "PYTHONPATH": f"{fake}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "WANDB_LOG": str(tmp_path / "wandb.jsonl")}
    proc = run(train_cmd(tmp_path / "w2", data_dir, "--config.wandb.project=p", "--config.max_steps=10"), env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    logged = [json.loads(line) for line in (tmp_path / "wandb.jsonl").read_text().splitlines()]
    assert logged[0][0] == 5 and "train/loss" in logged[0][1]


# -------------------------------------------------------------------------- SIGKILL, again and again


@pytest.mark.slow
def test_sigkill_at_random_steps_ten_times_resumes_bitwise(tmp_path: Path, data_dir: Path) -> None:
    """Ten kills in a row at seeded random moments; the final state equals an uninterrupted run's, bit for bit."""
    steps = ["--config.max_steps=200", "--config.ckpt_interval=10", "--config.eval_interval=50",
             "--config.model.resid_dropout=0.1"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert run(train_cmd(straight, data_dir, *steps)).returncode == 0
    rng, kept = np.random.default_rng(14), []
    for _ in range(10):
        proc = subprocess.Popen(train_cmd(killed, data_dir, *steps), cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        target, seen = int(rng.integers(1, 40)) * 5, []
        for line in proc.stderr:
            seen.append(line)
            if line.startswith("step ") and int(line.split("/")[0].split()[1]) >= target:
                break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        ckpt = Checkpointer(killed, read_only=True)
        kept.append(ckpt.latest_step())
        ckpt.close()
    assert sum(step is not None and step < 200 for step in kept) >= 5, kept  # most kills land mid-run
    assert run(train_cmd(killed, data_dir, *steps)).returncode == 0
    want, got = Checkpointer(straight, read_only=True), Checkpointer(killed, read_only=True)
    assert want.latest_step() == got.latest_step() == 200
    import jax

    a, b = want.restore_params(200), got.restore_params(200)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)
    from helpers import logged_losses

    assert logged_losses(killed) == logged_losses(straight)  # one row per step, none left by the kills
