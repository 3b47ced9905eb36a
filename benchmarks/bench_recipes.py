"""The GPT-2 recipe against the modern one on the quick start, measured in one run: steps and seconds to a loss.

    python benchmarks/bench_recipes.py                       # 300 GPT-2-recipe steps, seeds 0 and 1
    python benchmarks/bench_recipes.py --steps 700 --fraction 0.6 --plot benchmarks/results/recipes.png

Both recipes train configs/stdlib_char.py's model size (4 layers x 4 heads x 128 wide, 256 characters of
context) on its corpus with its batch, through the real trainer (`jaxgpt.train.loop.train`), and see the same
batches: step i's batch is a function of (seed, i) only, so for a given seed the modern run's tokens are the
first steps of the GPT-2 run's.

- GPT-2 recipe, configs/stdlib_char.py: learned positions, LayerNorm, GELU, biases, tied head; AdamW with a
  cosine schedule, here over `--steps`.
- Modern recipe, configs/stdlib_modern.py: nanochat's architecture at the same size (the "nanochat-d12"
  preset's options: rotary positions, parameter-free RMSNorm also after the embedding, QK-norm, ReLU^2, no
  biases, untied head, logits soft-capped at 15, zero-initialised projections) trained with Muon for the hidden
  matrices and AdamW for the rest, warmup-stable-decay with a linear cooldown over its last 40%, over
  `--fraction` x `--steps`.

Each runs its config file as it is, but for the length (and the schedule's: decay over the run, warmup at most
a tenth of it), the seed and the evaluation interval.

The target is the GPT-2 recipe's final validation loss (mean over the seeds). For each recipe the script prints
the first evaluated step at which its validation loss (mean over the seeds) is at or below the target, and the
seconds of training (compiles and evaluations included, as a user waits for them) to that step, then their
ratios. A modern run is a whole schedule of its own length, cooldown included: so it reaching the target by
its last step shows that `--fraction` of the steps suffice. Every evaluation uses the same held-out batches.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxgpt.commands import load_config_file, use_huge_pages
from jaxgpt.tasks import build
from jaxgpt.tools.plots import read_metrics
from jaxgpt.train.config import from_config_dict
from jaxgpt.train.loop import train

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
RECIPES = {"gpt2": "stdlib_char.py", "modern": "stdlib_modern.py"}  # the quick start, and it with the modern recipe


def recipe_config(workdir: Path, recipe: str, steps: int, seed: int, eval_interval: int, eval_batches: int):
    """`recipe`'s config file, `steps` long (its schedule too), evaluated every `eval_interval` steps."""
    c = load_config_file(str(CONFIGS / RECIPES[recipe]), f"configs/{RECIPES[recipe]}")
    c.workdir, c.seed, c.max_steps, c.log_interval = str(workdir), seed, steps, 10
    c.eval_interval, c.eval_batches, c.ckpt_interval = eval_interval, eval_batches, steps
    c.optim.decay_steps = steps
    c.optim.warmup_steps = min(c.optim.warmup_steps, steps // 10)
    c.sample.max_new_tokens = 0
    return c


def run(workdir: Path, recipe: str, steps: int, seed: int, args: argparse.Namespace) -> dict[str, list[float]]:
    """Train one recipe; its validation curve as steps, losses and seconds since the run began."""
    cfg = from_config_dict(recipe_config(workdir, recipe, steps, seed, args.eval_interval, args.eval_batches))
    start = time.time()
    train(cfg, build)
    rows = read_metrics(workdir)
    evals = [r for r in rows if "val_loss" in r]
    return {"step": [r["step"] for r in evals], "val_loss": [r["val_loss"] for r in evals],
            "seconds": [r["time"] - start for r in evals]}


def reach(curves: list[dict[str, list[float]]], target: float) -> tuple[int, float] | None:
    """The first evaluated step where the seeds' mean validation loss is <= target, and the mean seconds to it."""
    mean = np.mean([c["val_loss"] for c in curves], axis=0)
    hits = np.flatnonzero(mean <= target)
    if not hits.size:
        return None
    i = int(hits[0])
    return curves[0]["step"][i], float(np.mean([c["seconds"][i] for c in curves]))


def plot(curves: dict[str, list[dict[str, list[float]]]], target: float, path: str) -> None:
    """Validation loss against steps and against seconds, one line per run, the target dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for (recipe, runs), color in zip(curves.items(), ("tab:blue", "tab:orange"), strict=True):
        for seed, c in enumerate(runs):
            label = f"{recipe} recipe" if seed == 0 else None
            axes[0].plot(c["step"], c["val_loss"], color=color, alpha=0.8, label=label)
            axes[1].plot(c["seconds"], c["val_loss"], color=color, alpha=0.8, label=label)
    for ax, xlabel in zip(axes, ("step", "seconds of training (2-core CPU)"), strict=True):
        ax.axhline(target, color="gray", linestyle="--", linewidth=1)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("validation loss (nats per character)")
    axes[0].set_ylim(top=min(3.0, max(max(c["val_loss"]) for runs in curves.values() for c in runs)))
    axes[0].legend()
    fig.suptitle("Quick-start model: GPT-2 recipe vs modern recipe (dashed: GPT-2 recipe's final loss)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="the GPT-2 recipe's steps")
    parser.add_argument("--fraction", type=float, default=0.7, help="the modern recipe's steps, as a fraction")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--eval_interval", type=int, default=10)
    parser.add_argument("--eval_batches", type=int, default=4)
    parser.add_argument("--plot", default="", help="write the curves to this PNG")
    args = parser.parse_args()
    lengths = {"gpt2": args.steps, "modern": round(args.fraction * args.steps)}
    curves: dict[str, list[dict[str, list[float]]]] = {recipe: [] for recipe in lengths}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for recipe, steps in lengths.items():
                curves[recipe].append(run(Path(tmp) / f"{recipe}-{seed}", recipe, steps, seed, args))
    target = float(np.mean([c["val_loss"][-1] for c in curves["gpt2"]]))
    print(f"target: the GPT-2 recipe's final validation loss after {args.steps} steps, mean of seeds "
          f"{args.seeds}: {target:.4f}")
    reached = {recipe: reach(runs, target) for recipe, runs in curves.items()}
    for recipe, runs in curves.items():
        finals = ", ".join(f"{c['val_loss'][-1]:.4f}" for c in runs)
        hit = reached[recipe]
        where = f"reaches it at step {hit[0]} after {hit[1]:.0f} s" if hit else "does not reach it"
        print(f"{recipe:>6} recipe, {lengths[recipe]} steps: final validation losses {finals}; {where}")
    if reached["gpt2"] and reached["modern"]:
        (gpt2_steps, gpt2_s), (modern_steps, modern_s) = reached["gpt2"], reached["modern"]
        print(f"modern / GPT-2 recipe to the target: {modern_steps / gpt2_steps:.2f}x the steps, "
              f"{modern_s / gpt2_s:.2f}x the seconds")
    if args.plot:
        plot(curves, target, args.plot)
        print(f"curves: {args.plot}")


if __name__ == "__main__":
    use_huge_pages()  # as train.py does
    main()
