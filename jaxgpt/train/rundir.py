"""A run owns its work directory: one trainer at a time, never someone else's files, atomic rewrites.

On disk the lock is an `fcntl.flock` on `WORKDIR/jaxgpt.lock`. The kernel drops it when the holder dies,
however it dies, so a stale lock needs no cleanup: the next trainer simply gets it. The holder's PID is
written into the file once the run has passed its checks, so a refused start leaves every existing file as
it was. In a bucket, where there is no flock, a lease object does the same (`jaxgpt.train.lease`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

from jaxgpt import storage
from jaxgpt.errors import UserError
from jaxgpt.train.lease import LEASE_FILE, BucketLease

LOCK_FILE = "jaxgpt.lock"
CONFIG_FILE = "config.json"
STARTS_DIR = "starts"
METRICS_FILE = "metrics.jsonl"  # one JSON record a line (`train.logs.MetricsLog`, `tools.plots.read_metrics`)
# What a run writes at the top of its work directory besides its checkpoints (`check_not_foreign` adds
# io.checkpoint's two directories): a directory holding only these is a run's.
RUN_FILES = frozenset({METRICS_FILE, "tensorboard", CONFIG_FILE, STARTS_DIR, LOCK_FILE, LEASE_FILE, "wandb"})


def is_run_config(path: storage.Location) -> bool:
    """Whether `path` is a config.json a jaxgpt run wrote (a Hugging Face config.json is not)."""
    try:
        settings = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(settings, dict) and {"task", "workdir", "optim", "seed"} <= settings.keys()


def check_not_foreign(workdir: storage.Location) -> None:
    """Refuse a directory holding files a run did not write: training would overwrite or mix with them."""
    from jaxgpt.io.checkpoint import CHECKPOINT_DIR, CORRUPT_DIR  # orbax and jax: this module stays light to import

    entries = [name for name in storage.names(workdir) if not name.startswith(".")]
    config = workdir / CONFIG_FILE
    if config.exists() and not is_run_config(config):
        raise UserError(f"{workdir} holds a config.json that jaxgpt did not write (a Hugging Face checkpoint?): "
                        "choose another --config.workdir; nothing was changed")
    is_run = any(name in entries for name in (CHECKPOINT_DIR, CONFIG_FILE, METRICS_FILE))
    foreign = [name for name in entries if name not in RUN_FILES | {CHECKPOINT_DIR, CORRUPT_DIR}]
    if foreign and not is_run:
        raise UserError(f"{workdir} already holds files a jaxgpt run did not write ({', '.join(foreign[:3])}"
                        f"{', ...' if len(foreign) > 3 else ''}): choose an empty or new --config.workdir")


class WorkdirLock:
    """An exclusive, non-blocking lock on a work directory for the lifetime of one trainer."""

    def __init__(self, workdir: Path) -> None:
        self.path = workdir / LOCK_FILE
        self.recorded = False
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise UserError(f"cannot create the lock file {self.path} ({e.strerror}): choose another "
                            "--config.workdir") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(self.fd)
            raise UserError(f"{workdir} is in use by another training process (PID {holder}): wait for it to "
                            "end, stop it, or choose another --config.workdir") from None

    def check(self) -> None:
        """A flock cannot be lost while the process lives (a lease can: `BucketLease.check`)."""

    def record_holder(self) -> None:
        """Write this PID for a refused second trainer to name (only once the run is sure to start)."""
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)
        self.recorded = True

    def release(self) -> None:
        if self.recorded:  # a refused start leaves the file as it found it
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, 0)
        os.close(self.fd)  # closing drops the flock


Hold = WorkdirLock | BucketLease


def claim(workdir: storage.Location, lease_s: float) -> Hold:
    """This trainer's hold on `workdir`: a flock on disk, a lease in a bucket."""
    return BucketLease(workdir, lease_s) if storage.is_bucket(workdir) else WorkdirLock(workdir)


def record_start(workdir: storage.Location, settings: dict[str, Any], start_step: int) -> None:
    """config.json (the latest start) and starts/step-N-TIME.json: every start's resolved config is kept."""
    text = json.dumps(settings, indent=2) + "\n"
    starts = workdir / STARTS_DIR
    if not storage.is_bucket(starts):  # (a bucket has no directories to make)
        starts.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    storage.write_text(starts / f"step{start_step:08d}-{stamp}-{os.getpid()}.json", text)
    storage.write_text(workdir / CONFIG_FILE, text)

