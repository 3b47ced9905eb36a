"""Checkpoints with orbax: asynchronous, atomic, the last N plus the best by validation loss.

A checkpoint step directory holds three items: `params`, `opt_state` (both OCDBT pytrees,
restorable onto any mesh) and `meta` (JSON: step, resolved configs, the tokenizer, losses).
The checkpointer knows nothing of models: inference restores `params` from the shapes and dtypes
orbax recorded, and training passes the abstract state of its own layout (`jaxgpt.layout`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from jaxgpt.errors import UserError


def checkpoint_dir(workdir: str | os.PathLike[str]) -> Path:
    return Path(workdir).absolute() / "checkpoints"  # orbax insists on absolute paths


class Checkpointer:
    """Thin policy layer over `ocp.CheckpointManager` (which does the work)."""

    def __init__(self, workdir: str | os.PathLike[str], keep: int = 2, keep_best: bool = True,
                 read_only: bool = False) -> None:
        keep_policies: list[Any] = [policies.LatestN(n=keep)]
        if keep_best:
            keep_policies.append(policies.BestN(get_metric_fn=lambda m: -m["val_loss"], n=1,
                                                keep_checkpoints_without_metrics=False))
        options = ocp.CheckpointManagerOptions(
            preservation_policy=policies.AnyPreservationPolicy(keep_policies), cleanup_tmp_directories=True,
            create=not read_only, read_only=read_only, enable_async_checkpointing=True)
        self.directory = checkpoint_dir(workdir)
        handlers = {"params": ocp.StandardCheckpointHandler(), "opt_state": ocp.StandardCheckpointHandler(),
                    "meta": ocp.JsonCheckpointHandler()}  # registered, so that item metadata can be read
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def best_step(self) -> int | None:
        """The step with the lowest recorded validation loss (None if no checkpoint has one)."""
        scored = [(m["val_loss"], s) for s in self.manager.all_steps()
                  if (m := self.read_meta(s)).get("val_loss") is not None]
        return min(scored)[1] if scored else None

    def save(self, state: dict[str, Any], meta: dict[str, Any]) -> None:
        """Start an asynchronous save of `state` at its step; arrays may be donated right after."""
        step = int(jax.device_get(state["step"]))
        val_loss = meta.get("val_loss")
        self.manager.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(state["params"]), opt_state=ocp.args.StandardSave(state["opt_state"]),
            meta=ocp.args.JsonSave({**meta, "step": step})),
            metrics=None if val_loss is None else {"val_loss": float(val_loss)}, force=True)

    def read_meta(self, step: int) -> dict[str, Any]:
        return dict(self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])

    def restore(self, step: int, abstract_state: dict[str, Any]) -> dict[str, Any]:
        """The state saved at `step`, placed on the shardings of `abstract_state` (ShapeDtypeStructs)."""
        restored = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract_state["params"]),
            opt_state=ocp.args.StandardRestore(abstract_state["opt_state"])))
        return {"params": restored["params"], "opt_state": restored["opt_state"],
                "step": jax.device_put(np.int32(step), abstract_state["step"].sharding)}

    def restore_params(self, step: int, abstract_params: Any = None) -> Any:
        """The parameters saved at `step`: placed as `abstract_params` says, or (None) as saved in shape
        and dtype but on the default device, whatever mesh wrote them."""
        if abstract_params is None:
            device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            abstract_params = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                                           self.manager.item_metadata(step)["params"].tree)
        restored = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract_params)))
        return restored["params"]

    def wait(self) -> None:
        """Block until the background save has committed (its tmp directory renamed into place)."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def open_checkpoint(workdir: str | os.PathLike[str], which: str,
                    how_to_make: str) -> tuple[Checkpointer, int, dict[str, Any]]:
    """A read-only Checkpointer on `workdir`, its latest or best step, and that step's meta.

    `how_to_make` ends the errors with the way to get a checkpoint there. The caller closes the Checkpointer.
    """
    if which not in ("latest", "best"):
        raise UserError(f"checkpoint {which!r} is unknown: use 'latest' or 'best'")
    if not checkpoint_dir(workdir).is_dir():
        raise UserError(f"{workdir} has no checkpoints: {how_to_make}")
    ckpt = Checkpointer(workdir, read_only=True)
    step = ckpt.latest_step() if which == "latest" else ckpt.best_step()
    if step is None:
        ckpt.close()
        raise UserError(f"{workdir} has no {'finished' if which == 'latest' else 'evaluated'} checkpoint: "
                        + how_to_make + ("" if which == "latest" else ", or use --which latest"))
    return ckpt, step, ckpt.read_meta(step)
