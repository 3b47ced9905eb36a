"""Run ownership in a bucket: a lease object, since object stores have no flock.

`WORKDIR/jaxgpt.lease` is created with a create-only precondition (GCS `ifGenerationMatch=0`, S3
`If-None-Match: *`), so of two trainers starting on one path exactly one creates it; the other stops at
once naming the holder. The holder rewrites it every third of its period. A holder that dies stops
renewing, and a trainer finding a lease not renewed for longer than its period (or, on the holder's own
host, a lease whose process is gone) deletes it, says so, and creates its own. A renewal first re-reads
the lease: a holder that finds it taken over (it stalled for a whole period) stops with a message instead
of writing next to the new holder. Staleness compares the holder's clock with the reader's, so hosts'
clocks must agree to well within a period (NTP does).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid
from typing import Any

from etils import epath

from jaxgpt import storage
from jaxgpt.errors import UserError

LEASE_FILE = "jaxgpt.lease"


def _stamp(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def describe(lease: dict[str, Any]) -> str:
    return (f"host {lease.get('host')}, PID {lease.get('pid')}, since {_stamp(lease.get('since', 0))}, "
            f"renewed {time.time() - lease.get('renewed', 0):.0f} s ago")


def _dead_here(lease: dict[str, Any]) -> bool:
    """Whether the holder was a process on this host that no longer exists (a killed run restarted here need not
    wait out the period)."""
    if lease.get("host") != socket.gethostname() or not isinstance(lease.get("pid"), int):
        return False
    try:
        os.kill(lease["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


class BucketLease:
    """Held from construction to `release()`; `check()` raises once the lease is lost (taken over, or the
    bucket unreachable for a whole period)."""

    def __init__(self, workdir: epath.Path, period_s: float) -> None:
        import fsspec  # (with gcsfs / s3fs, which the bucket URL already required)

        self.url = str(workdir / LEASE_FILE)
        self.fs, self.key = fsspec.core.url_to_fs(self.url)
        self.period = period_s
        now = time.time()
        self.mine = {"holder": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid(), "since": now,
                     "renewed": now, "period": period_s}
        self.lost: UserError | None = None  # why the lease is not this run's any more
        self.failing_since: float | None = None  # of the renewals failing now
        with storage.guard(workdir, "taking the lease"):
            self._claim(workdir)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_until_stopped, name="jaxgpt-lease", daemon=True)
        self._thread.start()

    def _read(self) -> dict[str, Any] | None:
        try:
            lease = json.loads(self.fs.cat_file(self.key))
        except FileNotFoundError:
            return None
        except ValueError:  # cut or foreign: treat as a lease that nobody renews
            return {"renewed": 0, "period": 0}
        return lease if isinstance(lease, dict) else {"renewed": 0, "period": 0}

    def _in_use(self, workdir: epath.Path, lease: dict[str, Any]) -> UserError:
        return UserError(f"{workdir} is in use by another training process ({describe(lease)}): wait for it to "
                         f"end, stop it, or choose another --config.workdir (a lease not renewed for "
                         f"{lease.get('period', self.period):.0f} s is taken over)")

    def _claim(self, workdir: epath.Path) -> None:
        held = self._read()
        if held is not None:
            dead = _dead_here(held)
            if not dead and time.time() - held.get("renewed", 0) <= held.get("period", self.period):
                raise self._in_use(workdir, held)
            why = "its process is gone" if dead else "its holder stopped renewing it"
            print(f"warning: taking over {self.url}: {why} ({describe(held)})", file=sys.stderr, flush=True)
            self.fs.rm_file(self.key)
        try:
            self.fs.pipe_file(self.key, json.dumps(self.mine).encode(), mode="create")
        except FileExistsError:  # another trainer created it between our read and our write
            raise self._in_use(workdir, self._read() or {}) from None
        held = self._read() or {}
        if held.get("holder") != self.mine["holder"]:  # a store that ignored the precondition
            raise self._in_use(workdir, held)

    def _renew_until_stopped(self) -> None:
        while not self._stop.wait(self.period / 3):
            try:
                held = self._read()
                if held is None or held.get("holder") != self.mine["holder"]:
                    self.lost = UserError(f"the lease {self.url} was taken over by another trainer "
                                          f"({describe(held) if held else 'deleted'}): this run stopped renewing it "
                                          "in time")
                    return
                self.mine["renewed"] = time.time()
                self.fs.pipe_file(self.key, json.dumps(self.mine).encode())
                self.failing_since = None
            except Exception as e:
                self.failing_since = self.failing_since or time.time()
                if time.time() - self.failing_since > self.period:
                    self.lost = storage.failure(e, self.url, "renewing the lease")
                    return

    def record_holder(self) -> None:
        """The lease names its holder from the start (nothing else in the bucket changes before the checks)."""

    def check(self) -> None:
        if self.lost is not None:
            raise type(self.lost)(f"{self.lost}; the last committed checkpoint is kept: run the same command to resume")

    def release(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1)  # a renewal stuck retrying an unreachable store is not waited for
        if self.lost is None and self.failing_since is None and not self._thread.is_alive():
            try:
                if (self._read() or {}).get("holder") == self.mine["holder"]:
                    self.fs.rm_file(self.key)
            except Exception as e:  # the run's own outcome matters more than a lease left to expire
                print(f"warning: could not remove {self.url} ({type(e).__name__}); it expires after "
                      f"{self.period:.0f} s", file=sys.stderr, flush=True)
