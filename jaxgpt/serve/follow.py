"""`jaxgpt serve --follow`: serve each new checkpoint of a run that is still training.

A thread polls the run's checkpoints (a local directory or a bucket) every `interval` seconds. When the step
`--which` picks differs from the one served, it loads that checkpoint with the one weight loader
(`jaxgpt.io.weights.load`, as the server's start does) and hands the weights to the engine, which swaps them
between steps once its busy slots have finished (`Engine.swap`): no request in flight fails or mixes weights.
Only committed steps are listed (orbax renames or marks a step once it is whole), and a read-only checkpointer
leaves the trainer's unfinished saves alone. A step that cannot be read (corrupt, deleted while read) or whose
model, tokenizer or parameter shapes differ from the served ones is one line on stderr, once; the server
keeps serving what it served.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import jax

from jaxgpt.errors import one_line
from jaxgpt.generate.engine import Engine
from jaxgpt.io import weights
from jaxgpt.io.checkpoint import Checkpointer, CheckpointReadError


def version(step: int) -> str:
    """How responses (`system_fingerprint`) and /v1/models name the weights of a run's checkpoint."""
    return f"step-{step}"


def _layout(params: Any) -> Any:
    return jax.tree.map(lambda a: (a.shape, a.dtype), params)


class Follower:
    """Polls `workdir` in a thread of its own (`start`, `stop`) and swaps newer checkpoints into `engine`."""

    def __init__(self, engine: Engine, workdir: str, which: str, served: weights.Weights, interval: float) -> None:
        """`served`: the weights the engine was built with (a checkpoint of `workdir`): new ones must match them."""
        self.engine, self.workdir, self.which, self.interval = engine, workdir, which, interval
        self.model, self.tokenizer_meta, self.layout = served.model, served.tokenizer_meta, _layout(served.params)
        self.step: int = served.meta["step"]
        self.refused: set[int] = set()  # steps already reported as unusable (not retried)
        self.last_error: str | None = None  # a failing poll is reported once until it fails differently
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, name="jaxgpt-follow", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()

    def run(self) -> None:
        while not self.stopping.wait(self.interval):
            self.poll()

    def _say(self, line: str) -> None:
        print(f"follow {self.workdir}: {line}", file=sys.stderr, flush=True)

    def poll(self) -> None:
        """One look at the run: swap in its newest usable checkpoint, if that is not the one served."""
        try:
            ckpt = Checkpointer(self.workdir, read_only=True)
            try:
                step = ckpt.latest_step() if self.which == "latest" else ckpt.best_step()
            finally:
                ckpt.close()
            if step is None or step == self.step or step in self.refused:
                return
            loaded = weights.load(f"workdir:{self.workdir}", which=self.which)
        except Exception as e:  # a bucket's or orbax's failures come in many types: each is one line
            message = f"{type(e).__name__}: {one_line(e, 300)}"
            if message != self.last_error:
                self._say(f"{message}; still serving {version(self.step)}")
            self.last_error = message
            if isinstance(e, CheckpointReadError):
                self.refused.add(e.step)
            return
        self.last_error = None
        step = loaded.meta["step"]  # (a step newer than the one listed may have been committed meanwhile)
        if step == self.step:
            return
        if (loaded.model, loaded.tokenizer_meta) != (self.model, self.tokenizer_meta):
            reason = "its model or tokenizer differs from the served one"
        elif _layout(loaded.params) != self.layout:
            reason = "its parameter shapes or dtypes differ from the served ones"
        else:
            self.engine.swap(loaded.params, version(step))
            self._say(f"serving {version(step)} (was {version(self.step)})")
            self.step = step
            return
        self.refused.add(step)
        self._say(f"checkpoint step {step} not served: {reason}; still serving {version(self.step)}")
