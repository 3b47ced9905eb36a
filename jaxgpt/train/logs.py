"""A run's logs: metrics.jsonl, TensorBoard, optional Weights & Biases, and a plain line for batch jobs.

metrics.jsonl keeps one JSON object per record: `step`, the values (periodic records carry `train_loss`,
`lr`, `grad_norm`, `tokens_per_sec`; evaluations carry `val_loss` and the evaluation's `train_loss`) and
`time` (Unix seconds). TensorBoard and W&B get the same values under namespaced tags (train/loss,
eval/val_loss, perf/tokens_per_s, ...). Only process 0 writes. A run in a bucket writes both files into a
local mirror and uploads them at every checkpoint and at the end (`storage.Mirror`).
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import jax

from jaxgpt import storage
from jaxgpt.errors import optional_import
from jaxgpt.train.rundir import METRICS_FILE

# Periodic (training) values whose tag is not train/<name>.
TRAIN_TAGS = {"train_loss": "train/loss", "tokens_per_sec": "perf/tokens_per_s", "mfu": "perf/mfu"}


def tag(name: str, kind: str) -> str:
    """The TensorBoard / W&B tag of a value of a periodic ("train") or evaluation ("eval") record."""
    if kind == "eval":
        return f"eval/{name}"
    return TRAIN_TAGS.get(name) or f"train/{name.removeprefix('train_')}"


def kept_records(path: storage.Location, last_step: int) -> list[str]:
    """The lines of metrics.jsonl up to `last_step`: a resumed run (or a rerun after a kill before the first
    checkpoint, last_step 0) logs the later steps again, and a line cut by a crash is dropped."""
    kept = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= last_step:
            kept.append(line)
    return kept


def require_wandb(project: str) -> Any:
    """The wandb module when `project` asks for it (checked before compiling, not after)."""
    return optional_import("wandb", f"config.wandb.project={project!r} (Weights & Biases logging)",
                           otherwise="leave config.wandb.project empty")


def _wandb_run(project: str, name: str, workdir: storage.Location, settings: dict[str, Any],
               local: storage.Location) -> Any:
    """A W&B run that a resume continues (its id is derived from the work directory)."""
    wandb = require_wandb(project)
    run_id = hashlib.sha256(str(workdir).encode()).hexdigest()[:16]
    return wandb.init(project=project, name=name or workdir.name, id=run_id, resume="allow", dir=str(local),
                      config=settings)


class MetricsLog:
    """metrics.jsonl, TensorBoard events (unless config.tensorboard is off) and optionally W&B, written by process 0
    only."""

    def __init__(self, workdir: storage.Location, resume_step: int, settings: dict[str, Any],
                 wandb_project: str = "", wandb_name: str = "", tensorboard: bool = True) -> None:
        self.enabled = jax.process_index() == 0
        self.wandb = self.mirror = self.tb = None
        if not self.enabled:
            return
        local = workdir
        if storage.is_bucket(workdir):
            self.mirror = storage.Mirror(workdir)
            local = self.mirror.local
            self.mirror.fetch(METRICS_FILE)
        self.path = Path(local) / METRICS_FILE
        if self.path.exists():
            storage.write_text(self.path, "".join(line + "\n" for line in kept_records(self.path, resume_step)))
        if tensorboard:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(str(Path(local) / "tensorboard"), purge_step=resume_step)
        if wandb_project:
            self.wandb = _wandb_run(wandb_project, wandb_name, workdir, settings, local)

    def write(self, step: int, values: dict[str, Any], kind: str = "train") -> None:
        """Log the numeric scalars of `values`, and those of a dict of them one level down as "NAME/KEY" (a score per
        dataset: `val_exact_match_by_dataset/reverse`); other entries are for the caller."""
        values = {f"{name}/{key}" if key else name: float(v)
                  for name, value in values.items()
                  for key, v in (value.items() if isinstance(value, dict) else [("", value)])
                  if isinstance(v, int | float) and not isinstance(v, bool)}
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **values, "time": round(time.time(), 3)}) + "\n")
        tagged = {tag(name, kind): value for name, value in values.items()}
        if self.tb is not None:
            for name, value in tagged.items():
                self.tb.add_scalar(name, value, step)
        if self.wandb is not None:
            self.wandb.log(tagged, step=step)

    def sync(self) -> None:
        """Upload what changed to the bucket (nothing to do for a local work directory)."""
        if self.mirror is not None:
            if self.tb is not None:
                self.tb.flush()
            self.mirror.sync()

    def close(self, upload: bool = True) -> None:
        if self.enabled:
            if self.tb is not None:
                self.tb.close()
            if self.wandb is not None:
                self.wandb.finish()
            if self.mirror is not None and upload:
                self.mirror.sync()


def progress_line(step: int, max_steps: int, values: dict[str, float], elapsed: float) -> str:
    """One plain line per log interval for a log file (no carriage returns, unlike a progress bar)."""
    minutes, seconds = divmod(int(elapsed), 60)
    return (f"step {step}/{max_steps}: loss {values['train_loss']:.4f}, lr {values['lr']:.2e}, "
            f"{values['tokens_per_sec']:,.0f} tokens/s, elapsed {minutes // 60}:{minutes % 60:02d}:{seconds:02d}")
