"""`train.py` on the tiny config in a subprocess, and what its run directory holds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
