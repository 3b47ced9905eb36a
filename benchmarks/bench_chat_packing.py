"""Chat fine-tuning with packed rows against one conversation per row: which trains faster here, in one run.

    python benchmarks/bench_chat_packing.py                  # configs/chat_sft.py, 300 steps per layout
    python benchmarks/bench_chat_packing.py --steps 120 --rounds 2 --workdir /tmp/packing

Trains the config's run from its base model (configs/chat_sft.py: runs/stdlib_char, the quick start) for --steps
steps with config.chat.pack off and on, the same batch size, seed and schedule, in work directories `padded` and
`packed` under --workdir (which must not hold them yet: a run there would resume). The layouts take turns,
--rounds each (every turn resumes the run, which is exact), so load from other processes on the machine falls on
both alike. Per layout it prints seconds per step (the median over the log intervals of every turn, each turn's
first logged step left out: it holds the compilation), assistant tokens and conversations per step (counted in
the rows those steps drew: `Chat.train_rows`), assistant tokens per second, and the held-out loss and exact
match after the last step (one conversation per row either way); then packed over padded for each.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from pathlib import Path

import numpy as np
from ml_collections import ConfigDict

from jaxgpt.commands import load_config_file
from jaxgpt.tasks import build
from jaxgpt.tools.plots import read_metrics
from jaxgpt.train.config import from_config_dict
from jaxgpt.train.loop import train


def load_config(path: str, workdir: Path, steps: int, total: int, pack: bool) -> ConfigDict:
    """The config file's config with `pack`, in `workdir`, trained to step `steps` of a `total`-step schedule."""
    c = load_config_file(path, path)
    c.workdir, c.max_steps, c.optim.decay_steps, c.eval_interval = str(workdir), steps, total, total
    c.chat.pack = pack
    return c


def step_seconds(workdir: Path, after: int) -> list[float]:
    """Seconds per step between the periodic train records (those with an `lr`) past step `after`: from the first
    of them, so the steps before it, which hold the compilation, are left out."""
    logs = read_metrics(workdir)
    logs = [row for row in logs if "lr" in row and row["step"] > after]
    return [(b["time"] - a["time"]) / (b["step"] - a["step"]) for a, b in itertools.pairwise(logs)]


def drawn(c: ConfigDict) -> dict[str, float]:
    """Assistant tokens and conversations per step, counted in the rows the run's steps drew."""
    cfg = from_config_dict(c)
    task = build(cfg)
    rows = [task.train_rows(step, 0, 1) for step in range(cfg.max_steps)]
    per_row = lambda r: r["segments"].max(axis=1) if "segments" in r else np.ones(len(r["x"]))
    return {"assistant tok/step": float(np.mean([r["loss_mask"].sum() for r in rows])),
            "conversations/step": float(np.mean([per_row(r).sum() for r in rows]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/chat_sft.py")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3, help="turns each layout takes (a resumed run each)")
    parser.add_argument("--workdir", default="/tmp/bench_chat_packing")
    args = parser.parse_args()
    root = Path(args.workdir)
    runs = {"padded": False, "packed": True}
    if taken := [name for name in runs if (root / name).exists()]:
        parser.error(f"{root} already holds {', '.join(taken)}: give a new --workdir")
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    final: dict[str, dict] = {}  # each layout's metrics after its last step
    for k in range(args.rounds):
        done, until = args.steps * k // args.rounds, args.steps * (k + 1) // args.rounds
        for name, pack in runs.items():
            final[name] = train(from_config_dict(load_config(args.config, root / name, until, args.steps, pack)), build)
            seconds[name] += step_seconds(root / name, after=done)
    results = {}
    for name, pack in runs.items():
        row = {"s/step": statistics.median(seconds[name]), **drawn(load_config(args.config, root / name, args.steps,
                                                                               args.steps, pack))}
        results[name] = {**row, "assistant tok/s": row["assistant tok/step"] / row["s/step"],
                         "val loss": final[name]["val_loss"], "val exact match": final[name]["val_exact_match"]}
    keys = list(results["padded"])
    print(f"{'':>16}" + "".join(f"{k:>20}" for k in keys))
    for name, row in results.items():
        print(f"{name:>16}" + "".join(f"{row[k]:>20.4g}" for k in keys))
    print(f"{'packed / padded':>16}" + "".join(f"{results['packed'][k] / results['padded'][k]:>20.3f}" for k in keys))


if __name__ == "__main__":
    main()
