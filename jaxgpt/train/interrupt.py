"""Stopping a run on request: SIGINT (Ctrl-C) and SIGTERM (schedulers, preemption) end a run cleanly.

The first signal only sets a flag: the loop finishes the step it is on, writes a checkpoint, waits for it to
commit and exits with a one-line message. The handlers are then back to the default, so a second signal
ends the process at once, even inside a long XLA computation. That cannot corrupt a checkpoint: orbax
writes each one into a temporary directory that is renamed into place only once complete.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType, TracebackType
from typing import Any

from jaxgpt.errors import InterruptError

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GracefulStop:
    """A context in which SIGINT / SIGTERM request a stop (`requested`) instead of killing the process."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum
        for s in SIGNALS:
            signal.signal(s, signal.SIG_DFL)
        # os.write, not print: the handler may run while the main thread is inside a print to stderr.
        os.write(2, f"\n{signal.Signals(signum).name}: stopping after this step and saving a checkpoint (send it "
                    "again to exit at once; the last checkpoint is kept)\n".encode())

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def stopped(self, step: int, where: str) -> InterruptError:
        """The exception that ends the run once its checkpoint at `step` has committed."""
        assert self.signum is not None
        name = signal.Signals(self.signum).name
        return InterruptError(f"stopped by {name} at step {step}; checkpoint saved in {where}: run the same command "
                           "to resume", status=128 + self.signum)
