"""Resuming safely: the same run or a refusal, and a readable checkpoint or a message that says which one.

A checkpoint records the run's trajectory: every setting that changes which updates are made (seed,
task, batch, model, optimizer and schedule, the data's content by hash). Resuming with any of them changed
would silently train a different run than the one the checkpoint and metrics describe, so it is refused
with the list of changed keys unless `config.resume_changes` says it is meant. Settings that only change
how the run is observed or laid out (intervals, mesh, workdir, max_steps with an explicit decay) may change.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

import jax

from jaxgpt.errors import UserError
from jaxgpt.io.checkpoint import Checkpointer, CheckpointReadError
from jaxgpt.model.config import ModelConfig
from jaxgpt.train.config import TrainConfig
from jaxgpt.train.optim import OptimConfig

# What makes two datasets the same for training: the tokens and how to read them (not where they came from).
DATA_KEYS = ("tokenizer", "vocab_size", "n_train", "n_val", "train_sha256", "val_sha256", "shards")


def flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def trajectory(cfg: TrainConfig, model: dict[str, Any], task_meta: dict[str, Any]) -> dict[str, Any]:
    """The settings that decide the run's updates, as flat JSON-able keys (saved with every checkpoint)."""
    dataset = task_meta.get("dataset") or {}
    values = {"task": cfg.task, "seed": cfg.seed, "batch_size": cfg.batch_size, "grad_accum": cfg.grad_accum,
              "model": model, "optim": dataclasses.asdict(cfg.optim),
              "data": {k: dataset[k] for k in DATA_KEYS if k in dataset}}
    if cfg.data.align_documents:  # absent when off, as label_smoothing
        values["data"]["align_documents"] = True
    if cfg.label_smoothing:  # absent at 0, so runs saved before the setting existed resume unchanged
        values["label_smoothing"] = cfg.label_smoothing
    if cfg.z_loss:  # likewise
        values["z_loss"] = cfg.z_loss
    if cfg.task in ("classify", "seq2seq"):
        values[cfg.task] = dataclasses.asdict(getattr(cfg, cfg.task))
    return flatten(json.loads(json.dumps(values)))  # as a checkpoint's JSON gives it back (tuples as lists)


def changed_keys(saved: dict[str, Any], now: dict[str, Any], defaults: dict[str, Any] | None = None) -> list[str]:
    """Whether a run's settings changed: the keys whose values differ, sorted. A key that one side lacks counts
    as its default: a setting added later, at its default, trains the same run as before it existed. `defaults`
    are the trajectory's (`trajectory`: the model's and optimizer's keys) unless given (RL's settings)."""
    if defaults is None:
        defaults = flatten(json.loads(json.dumps({"model": ModelConfig().to_dict(),
                                                  "optim": dataclasses.asdict(OptimConfig())})))
    return sorted(k for k in saved.keys() | now.keys() if saved.get(k, defaults.get(k)) != now.get(k, defaults.get(k)))


def check_same_run(saved_meta: dict[str, Any], now: dict[str, Any], cfg: TrainConfig) -> None:
    """A UserError listing the changed trajectory keys, unless there are none or the user opted in."""
    saved = saved_meta.get("trajectory")
    if saved is None:  # written before trajectories were recorded: the task's own check is all there is
        return
    changed = changed_keys(saved, now)
    if not changed or cfg.resume_changes:
        return
    shown = ", ".join(f"{k} ({saved.get(k)!r} -> {now.get(k)!r})" if not k.startswith("data.") else k
                      for k in changed[:6])
    raise UserError(f"resuming {cfg.workdir} with settings that change the run: {shown}"
                    f"{', ...' if len(changed) > 6 else ''}; pass --config.resume_changes=True to continue "
                    "with them anyway, or use a new --config.workdir")


def restore_readable(cfg: TrainConfig, ckpt: Checkpointer, abstract_state: dict[str, Any],
                     check: Any) -> tuple[dict[str, Any], int]:
    """The state of the newest checkpoint, after `check(saved_meta)` accepts it.

    A checkpoint that cannot be read is an error naming its step, unless `cfg.resume_fallback`: then it is
    moved to corrupt-checkpoints/ (never deleted) and the next older one is tried.
    """
    for step in reversed(ckpt.all_steps()):
        try:
            saved_meta = ckpt.read_meta(step)
            check(saved_meta)
            return ckpt.restore(step, abstract_state), step
        except CheckpointReadError as e:
            if not cfg.resume_fallback:
                raise UserError(f"{e}: pass --config.resume_fallback=True to resume from the newest readable "
                                f"checkpoint (unreadable ones are moved to corrupt-checkpoints/), or start a new "
                                "--config.workdir") from None
            if jax.process_index() == 0:
                moved = ckpt.set_aside(step)
                print(f"warning: {e}; moved it to {moved}, trying the previous checkpoint", file=sys.stderr,
                      flush=True)
    raise UserError(f"no checkpoint in {ckpt.directory} can be read: start a new --config.workdir")
