"""`train.py` on the tiny config in a subprocess, and what its run directory holds."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import traverse_util

from helpers import ROOT, TINY, logged_losses
from jaxgpt.io.checkpoint import Checkpointer


def train_cmd(workdir: Path, data_dir: Path, cache: str, *extra: str) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), f"--config={TINY}", f"--config.workdir={workdir}",
            f"--config.data.dir={data_dir}", f"--config.compilation_cache_dir={cache}", *extra]


def run(cmd: list[str], *, check: bool = False, **kwargs: object) -> subprocess.CompletedProcess:
    """The tests' one command runner: `cmd` from the repository's root, its output captured as text, within 300 s
    (`kwargs` are subprocess.run's: env, cwd, timeout); with `check`, a non-zero status fails with stderr's tail."""
    proc = subprocess.run(cmd, **{"capture_output": True, "text": True, "timeout": 300, "cwd": ROOT, **kwargs})
    if check and proc.returncode:
        raise AssertionError(proc.stderr[-3000:])
    return proc


def run_train(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return run(list(args), check=check)


def final_params(workdir: Path) -> dict:
    ckpt = Checkpointer(workdir, read_only=True)
    step = ckpt.latest_step()
    restored = ckpt.manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore()))
    ckpt.close()
    return traverse_util.flatten_dict(dict(restored["params"]))


def train_losses(workdir: Path) -> dict[int, float]:
    return dict(logged_losses(workdir))


def killed_twice_equals_straight(flags: Callable[[Path], list[str]], tmp_path: Path, last_step: int,
                                 targets: tuple[int, int] = (5, 11)) -> None:
    """The command `flags(workdir)` run straight through, and run again in another work directory killed with
    SIGKILL once it logged step `targets[0]` or later, again at `targets[1]`, then resumed to the end: both end at
    `last_step` with the same weights bit for bit (the chat tasks' SIGKILL tests)."""
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    done = subprocess.run(flags(straight), capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    for target in targets:
        proc = subprocess.Popen(flags(killed), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for line in proc.stderr:
            if line.startswith("step ") and int(line.split("/")[0].split()[1]) >= target:
                break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    resumed = subprocess.run(flags(killed), capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert resumed.returncode == 0 and "resuming at step" in resumed.stdout, resumed.stderr[-2000:]
    want, got = Checkpointer(straight, read_only=True), Checkpointer(killed, read_only=True)
    assert want.latest_step() == got.latest_step() == last_step
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
                 want.restore_params(last_step), got.restore_params(last_step))
