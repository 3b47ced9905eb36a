"""Checkpoints with orbax: asynchronous, atomic, the last N plus the best by validation loss.

A checkpoint step directory holds three items: `params`, `opt_state` (both OCDBT pytrees,
restorable onto any mesh) and `meta` (JSON: step, resolved configs, the tokenizer, losses).
The checkpointer knows nothing of models: inference restores `params` from the shapes and dtypes
orbax recorded, and training passes the abstract state of its own layout (`jaxgpt.train.sharding`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from jaxgpt import storage
from jaxgpt.errors import StorageError, UserError

CHECKPOINT_DIR = "checkpoints"  # in the work directory (`checkpoint_dir`)
CORRUPT_DIR = "corrupt-checkpoints"  # where an opted-in fallback moves checkpoints that cannot be read
_LISTING_ATTEMPTS = 5  # a reader lists again when a step vanishes under it (another process's cleanup)


class CheckpointReadError(UserError):
    """A checkpoint step that exists but cannot be read (deleted or truncated files, a corrupt manifest)."""

    def __init__(self, directory: Path, step: int, error: BaseException) -> None:
        reason = " ".join(f"{type(error).__name__}: {error}".split())[:300]
        super().__init__(f"checkpoint step {step} in {directory} cannot be read ({reason})")
        self.step = step


def _quiet_closed_loop() -> None:
    """Drop the noise that orbax's threads leave behind a failed save or read.

    When one write of an asynchronous save fails (a full disk), or one array of a checkpoint cannot be read
    (corrupt), orbax closes its event loop while other writes or reads are still completing; each then
    reports, as an unraisable exception with a traceback, that it cannot call back into the closed loop. The
    failure itself is raised (`wait`, `CheckpointReadError`) and reported once.
    """
    previous = sys.unraisablehook
    if getattr(previous, "jaxgpt_quiet", False):
        return

    def hook(unraisable: Any) -> None:
        if not (isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"):
            previous(unraisable)

    hook.jaxgpt_quiet = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


DRAIN_S = 60.0  # at most this long for the reads still pending when one has failed to end (see below)


async def _cancelling_on_failure(work: Coroutine[Any, Any, Any]) -> Any:
    """`await work`; when it raises, first cancel every other task of this event loop and wait for their end.

    Orbax runs each restore in a fresh event loop of its own and closes that loop as soon as the restore
    raises. When one array of a checkpoint cannot be read, the reads of the others are still pending there:
    left so, each is destroyed at exit and prints a traceback ("Exception ignored in: <coroutine ...
    _read_array_index_and_device_put>", hundreds of lines after the one-line error). Cancelled and awaited
    here, they end before the loop closes, as `asyncio.run` would end them.
    """
    try:
        return await work
    except BaseException:
        pending = asyncio.all_tasks() - {asyncio.current_task()}
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=DRAIN_S)
        for task in pending:  # (their failures are the one being raised, or its consequence: seen, not reported)
            if task.done() and not task.cancelled():
                task.exception()
        raise


def _end_pending_reads() -> None:
    """Route orbax's synchronous runner through `_cancelling_on_failure` (once per process). Every orbax call
    that runs a coroutine to completion goes through `asyncio_utils.run_sync`, each in its own event loop
    (a fresh one, or one in a thread of its own), so "every other task of this event loop" is this call's."""
    from orbax.checkpoint._src import asyncio_utils

    run_sync = asyncio_utils.run_sync
    if getattr(run_sync, "jaxgpt_cancelling", False):
        return

    def run_sync_cancelling(coro: Coroutine[Any, Any, Any]) -> Any:
        return run_sync(_cancelling_on_failure(coro))

    run_sync_cancelling.jaxgpt_cancelling = True  # type: ignore[attr-defined]
    asyncio_utils.run_sync = run_sync_cancelling


def state_bytes(tree: Any) -> int:
    """Bytes of every array (or ShapeDtypeStruct) in `tree`: about what one checkpoint takes on disk."""
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def checkpoint_dir(workdir: str | os.PathLike[str]) -> storage.Location:
    """WORKDIR/checkpoints: an absolute local path (orbax insists) or a bucket URL (an `epath.Path`)."""
    return storage.location(workdir, "the work directory") / CHECKPOINT_DIR


class Checkpointer:
    """Thin policy layer over `ocp.CheckpointManager` (which does the work)."""

    def __init__(self, workdir: str | os.PathLike[str], keep: int = 2, keep_best: bool = True,
                 read_only: bool = False) -> None:
        keep_policies: list[Any] = [policies.LatestN(n=keep)]
        if keep_best:
            keep_policies.append(policies.BestN(get_metric_fn=lambda m: -m["val_loss"], n=1,
                                                keep_checkpoints_without_metrics=False))
        self.directory = checkpoint_dir(workdir)
        self.in_bucket = storage.is_bucket(self.directory)
        # Object stores cannot rename a directory: there a step is committed by a file written after the rest.
        mode = ocp.options.AtomicityMode.COMMIT_FILE if self.in_bucket else ocp.options.AtomicityMode.ATOMIC_RENAME
        options = ocp.CheckpointManagerOptions(
            preservation_policy=policies.AnyPreservationPolicy(keep_policies), cleanup_tmp_directories=True,
            create=not read_only, read_only=read_only, enable_async_checkpointing=True,
            atomicity_options=ocp.options.AtomicityOptions(mode=mode))
        handlers = {"params": ocp.StandardCheckpointHandler(), "opt_state": ocp.StandardCheckpointHandler(),
                    "meta": ocp.JsonCheckpointHandler()}  # registered, so that item metadata can be read
        for attempt in range(_LISTING_ATTEMPTS):
            try:
                with storage.guard(self.directory, "opening checkpoints in"):
                    self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
                break
            except (FileNotFoundError, NotADirectoryError):  # a step deleted (a trainer's keep policy) while listed
                if attempt == _LISTING_ATTEMPTS - 1:
                    raise
        self._bytes = 0  # of the last state saved, for the message of a full disk
        _end_pending_reads()
        _quiet_closed_loop()
        if not read_only:  # a failed save's tasks are logged at exit ("Task exception was never retrieved")
            logging.getLogger("asyncio").setLevel(logging.CRITICAL)

    def latest_step(self) -> int | None:
        with storage.guard(self.directory, "listing checkpoints in"):
            return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        with storage.guard(self.directory, "listing checkpoints in"):
            return sorted(self.manager.all_steps())

    def set_aside(self, step: int) -> storage.Location:
        """Move an unreadable step out of the manager's sight (kept for inspection, never deleted), so that
        training resumed from an earlier step can save this step number again."""
        target = self.directory.parent / CORRUPT_DIR / str(step)
        if not self.in_bucket:  # (a bucket has no directories to make)
            target.parent.mkdir(exist_ok=True)
        if target.exists():
            target = target.with_name(f"{step}-{os.getpid()}")
        storage.move_dir(self.directory / str(step), target)
        self.manager.reload()
        return target

    def best_step(self) -> int | None:
        """The step with the lowest recorded validation loss (None if no checkpoint has one)."""
        scored = [(m["val_loss"], s) for s in self.manager.all_steps()
                  if (m := self.read_meta(s)).get("val_loss") is not None]
        return min(scored)[1] if scored else None

    def save(self, state: dict[str, Any], meta: dict[str, Any]) -> None:
        """Start an asynchronous save of `state` at its step; arrays may be donated right after."""
        step = int(jax.device_get(state["step"]))
        val_loss = meta.get("val_loss")
        self._bytes = state_bytes([state["params"], state["opt_state"]])
        self._writing(lambda: self.manager.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(state["params"]), opt_state=ocp.args.StandardSave(state["opt_state"]),
            meta=ocp.args.JsonSave({**meta, "step": step})),
            metrics=None if val_loss is None else {"val_loss": float(val_loss)}, force=True))

    def _writing(self, write: Callable[[], Any]) -> Any:
        """Run a save or a wait for one; a full disk (now, or in the background save) becomes a UserError
        naming the directory and the space a checkpoint needs. Orbax commits by renaming a finished
        temporary directory, so the previous checkpoint is intact whatever failed."""
        try:
            return write()
        except Exception as e:
            if self.in_bucket:
                error = storage.failure(e, str(self.directory), "writing a checkpoint into")
                raise StorageError(f"{error}; the checkpoints committed before this save are intact: run the same "
                                   "command to resume") from None
            fault = storage.disk_error(e)
            if fault is None:
                raise
            steps = self.manager.all_steps()
            kept = f"step {max(steps)} is intact" if steps else "there is no earlier checkpoint"
            raise UserError(f"writing a checkpoint into {self.directory} failed ({fault.strerror or fault}): it "
                            f"needs about {self._bytes / 2**20:,.1f} MiB, "
                            f"{storage.free_bytes(self.directory) / 2**20:,.1f} MiB are free there (or a file-size "
                            f"limit applies); {kept}. Free space, then run the same command to resume") from None

    def read_meta(self, step: int) -> dict[str, Any]:
        return dict(self._reading(step, lambda: self.manager.restore(
            step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())))["meta"])

    def restore(self, step: int, abstract_state: dict[str, Any]) -> dict[str, Any]:
        """The state saved at `step`, placed on the shardings of `abstract_state` (ShapeDtypeStructs)."""
        restored = self._reading(step, lambda: self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract_state["params"]),
            opt_state=ocp.args.StandardRestore(abstract_state["opt_state"]))))
        return {"params": restored["params"], "opt_state": restored["opt_state"],
                "step": jax.device_put(np.int32(step), abstract_state["step"].sharding)}

    def restore_params(self, step: int, abstract_params: Any = None) -> Any:
        """The parameters saved at `step`: placed as `abstract_params` says, or (None) as saved in shape
        and dtype but on the default device, whatever mesh wrote them."""
        def read() -> Any:
            abstract = abstract_params
            if abstract is None:
                device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
                abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                                        self.manager.item_metadata(step)["params"].tree)
            return self.manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract)))

        return self._reading(step, read)["params"]

    def _reading(self, step: int, read: Callable[[], Any]) -> Any:
        """`read()`, whatever the library's reason for failing turned into one CheckpointReadError (the reads
        of the step's other arrays still pending then are ended first: `_cancelling_on_failure`)."""
        try:
            return read()
        except Exception as e:
            raise CheckpointReadError(self.directory, step, e) from None

    def wait(self) -> None:
        """Block until the background save has committed (its tmp directory renamed into place)."""
        self._writing(self.manager.wait_until_finished)

    def close(self) -> None:
        self.manager.close()


def open_checkpoint(workdir: str | os.PathLike[str], which: str,
                    how_to_make: str) -> tuple[Checkpointer, int, dict[str, Any]]:
    """A read-only Checkpointer on `workdir`, its latest or best step, and that step's meta.

    `how_to_make` ends the errors with the way to get a checkpoint there. The caller closes the Checkpointer.
    """
    if which not in ("latest", "best"):
        raise UserError(f"checkpoint {which!r} is unknown: use 'latest' or 'best'")
    directory = checkpoint_dir(workdir)
    with storage.guard(directory, "reading"):
        if not directory.is_dir():
            raise UserError(f"{workdir} has no checkpoints: {how_to_make}")
    ckpt = Checkpointer(workdir, read_only=True)
    step = ckpt.latest_step() if which == "latest" else ckpt.best_step()
    if step is None:
        ckpt.close()
        raise UserError(f"{workdir} has no {'finished' if which == 'latest' else 'evaluated'} checkpoint: "
                        + how_to_make + ("" if which == "latest" else ", or use --which latest"))
    return ckpt, step, ckpt.read_meta(step)
