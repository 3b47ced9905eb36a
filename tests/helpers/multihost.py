"""Multi-host training on one machine: `train.py` processes of fake CPU devices, each under `timeout`, in its own
session, logging to files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from flax import traverse_util

from helpers import ROOT, TINY, fake_devices_env, free_port
from jaxgpt.io.weights import load

STEPS = 10


COMMON = ["--config.model.n_head=4", f"--config.max_steps={STEPS}", "--config.log_interval=1",
          f"--config.eval_interval={STEPS}", "--config.ckpt_interval=5"]


def start(workdir: Path | str, data_dir: Path, devices: int, *extra: str, log: Path,
          seconds: int = 240) -> subprocess.Popen:
    """train.py under `timeout`, in its own session (so a kill takes the whole process group)."""
    cmd = ["timeout", str(seconds), sys.executable, str(ROOT / "train.py"), f"--config={TINY}",
           f"--config.workdir={workdir}", f"--config.data.dir={data_dir}", *COMMON, *extra]
    env = fake_devices_env(devices)
    with open(f"{log}.out", "w") as out, open(f"{log}.err", "w") as err:  # files, not pipes: no pipe deadlock
        return subprocess.Popen(cmd, stdout=out, stderr=err, cwd=ROOT, env=env, start_new_session=True)


def start_pair(workdir: Path | str, data_dir: Path, *extra: str, logs: Path, heartbeat: int = 10,
               seconds: int = 240) -> list[subprocess.Popen]:
    port = free_port()
    return [start(workdir, data_dir, 2, "--config.distributed.enabled=True",
                  f"--config.distributed.coordinator_address=127.0.0.1:{port}",
                  "--config.distributed.num_processes=2", f"--config.distributed.process_id={i}",
                  "--config.distributed.initialization_timeout=60",
                  f"--config.distributed.heartbeat_timeout={heartbeat}", *extra, log=logs / f"p{i}",
                  seconds=seconds) for i in (0, 1)]


def kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def finish(procs: list[subprocess.Popen], timeout: float = 300) -> list[int]:
    try:
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        kill_all(procs)


def final_params(workdir: Path | str) -> dict:
    loaded = load(f"workdir:{workdir}")  # onto this process's one device: a resharding restore
    assert loaded.meta["step"] == STEPS
    return traverse_util.flatten_dict(loaded.params)


# Data split across the hosts, tensor within them; two micro-batches, whose rows interleave across hosts.
MESH = ["--config.mesh.data=2", "--config.mesh.fsdp=1", "--config.mesh.tensor=2", "--config.grad_accum=2"]
