"""Pictures of a run: training curves from metrics.jsonl, and attention heatmaps for a prompt.

Each figure has a data function (plain numpy, testable without looking at pixels) and a drawing
function that only lays the numbers out. Drawing uses matplotlib's Agg backend, so no display is needed.
The command line is `jaxgpt plots curves ...` / `jaxgpt plots attention ...`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxgpt.config import ModelConfig
from jaxgpt.errors import UserError

METRICS_FILE = "metrics.jsonl"
Series = tuple[np.ndarray, np.ndarray]  # (steps, values)


def _pyplot() -> Any:
    """pyplot on the Agg backend, chosen before pyplot is first imported so that no GUI is ever touched."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ---------------------------------------------------------------------------------------------------
# Training curves


def read_metrics(workdir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of WORKDIR/metrics.jsonl.

    Training appends to the file while it runs, so an incomplete last line is skipped rather than
    reported; a broken line elsewhere means a damaged file and is an error.
    """
    path = Path(workdir) / METRICS_FILE
    if not path.is_file():
        raise UserError(f"{path} does not exist: pass the --workdir of a training run (it writes {METRICS_FILE})")
    lines = path.read_text().splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                continue
            raise UserError(f"{path}:{number} is not valid JSON: the metrics file is damaged") from None
        if isinstance(record, dict) and isinstance(record.get("step"), int | float):
            records.append(record)
    if not records:
        raise UserError(f"{path} has no records with a step yet: train for at least one log interval")
    return records


def metric_series(records: Sequence[dict[str, Any]], key: str, eval_records: bool | None = None) -> Series:
    """(steps, values) of one metric, sorted by step, the last record winning when a step repeats.

    The trainer writes two kinds of record: periodic ones (loss of the last batch, lr, speed) and
    evaluation ones (which carry val_loss, and a train_loss measured on held-out batches). Mixing the
    two train losses in one line would zig-zag, so `eval_records` selects one kind (None: both).
    """
    by_step: dict[float, float] = {}
    for record in records:
        if eval_records is not None and ("val_loss" in record) != eval_records:
            continue
        value = record.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            by_step[float(record["step"])] = float(value)
    steps = np.array(sorted(by_step), dtype=np.float64)
    return steps, np.array([by_step[s] for s in steps], dtype=np.float64)


def curve_panels(records: Sequence[dict[str, Any]]) -> list[tuple[str, list[tuple[str, Series]]]]:
    """The panels of the training figure: (y label, [(legend label, series)]), empty series included."""
    panels = [
        ("loss", [("train (logged batches)", metric_series(records, "train_loss", eval_records=False)),
                  ("train (evaluation)", metric_series(records, "train_loss", eval_records=True)),
                  ("validation", metric_series(records, "val_loss"))]),
        ("learning rate", [("lr", metric_series(records, "lr"))]),
        ("tokens / s", [("throughput", metric_series(records, "tokens_per_sec"))]),
    ]
    grad_norm = metric_series(records, "grad_norm")
    if len(grad_norm[0]):
        panels.append(("gradient norm", [("grad norm", grad_norm)]))
    return panels


def plot_training_curves(records: Sequence[dict[str, Any]], out: str | os.PathLike[str], title: str = "") -> Path:
    """One panel per quantity, stacked on a shared step axis, written as a PNG."""
    plt = _pyplot()
    panels = curve_panels(records)
    ratios = [2] + [1] * (len(panels) - 1)
    fig, axes = plt.subplots(len(panels), 1, sharex=True, figsize=(9, 2.2 * sum(ratios) + 0.6),
                             gridspec_kw={"height_ratios": ratios}, constrained_layout=True)
    styles = {"train (logged batches)": dict(lw=1.0, alpha=0.8),
              "train (evaluation)": dict(marker="s", ms=4, lw=1.2, ls="--"),
              "validation": dict(marker="o", ms=4, lw=1.6)}
    for ax, (ylabel, lines) in zip(axes, panels, strict=True):
        drawn = 0
        for label, (steps, values) in lines:
            if len(steps):
                ax.plot(steps, values, label=label, **styles.get(label, dict(lw=1.2)))
                drawn += 1
        if not drawn:
            ax.text(0.5, 0.5, f"no {ylabel} logged", transform=ax.transAxes, ha="center", va="center", color="0.5")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if len(lines) > 1 and drawn:
            ax.legend(loc="upper right", fontsize=9)
    axes[0].set_title(title or "training curves")
    axes[-1].set_xlabel("step")
    for ax in axes[1:]:
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# ---------------------------------------------------------------------------------------------------
# Attention heatmaps


def attention_maps(params: Any, cfg: ModelConfig, ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Attention probabilities (L, H, T, T) of one token sequence: row t is query t's weights over keys.

    They come from the weights the model sows into `intermediates`, which only the einsum attention
    path computes explicitly, so that path is forced here; it gives the same outputs as the fused ones.
    """
    import jax
    import jax.numpy as jnp

    from jaxgpt.model import GPT

    ids = np.asarray(ids, dtype=np.int32).reshape(-1)
    if ids.size == 0:
        raise UserError("the prompt is empty: give at least one token")
    if ids.size > cfg.block_size:
        raise UserError(f"the prompt has {ids.size} tokens but the model sees at most {cfg.block_size}: shorten it")
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise UserError(f"token ids must be in [0, {cfg.vocab_size}), got {ids.min()}..{ids.max()}")
    run_cfg = cfg.replace(attention_impl="einsum", remat="none")
    model = GPT(run_cfg)

    @jax.jit
    def sown(p: Any, idx: jax.Array) -> Any:
        _, state = model.apply({"params": p}, idx, mutable=["intermediates"])
        return state["intermediates"]

    inter = sown(params, jnp.asarray(ids)[None])
    if cfg.scan_layers:
        stacked = np.asarray(inter["h"]["attn"]["attn_weights"][0])  # (L, B, H, T, T)
    else:
        stacked = np.stack([np.asarray(inter[f"h_{i}"]["attn"]["attn_weights"][0]) for i in range(cfg.n_layer)])
    return stacked[:, 0].astype(np.float64)


def visible_token(text: str) -> str:
    """A token's text as an axis label: whitespace made visible, so ' the' and 'the' differ on the plot."""
    shown = text.replace("\n", "↵").replace("\t", "⇥").replace("\r", "␍").replace(" ", "·")
    return shown if shown else "∅"


def token_labels(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """One label per token, decoded one id at a time (a token that is part of a UTF-8 character shows �)."""
    return [visible_token(tokenizer.decode([int(i)])) for i in ids]


def plot_attention(maps_HTT: np.ndarray, labels: Sequence[str], out: str | os.PathLike[str], title: str = "") -> Path:
    """A grid of heatmaps, one per head, sharing a 0..1 color scale; queries down, keys across."""
    plt = _pyplot()
    H, T, _ = maps_HTT.shape
    if len(labels) != T:
        raise ValueError(f"{len(labels)} labels for {T} tokens")
    ncols = math.ceil(math.sqrt(H))  # near-square grid: 4 heads 2x2, 12 heads 4x3
    nrows = math.ceil(H / ncols)
    longest = max(len(s) for s in labels)
    fontsize = 9 if T <= 32 else 7 if T <= 64 else 5
    panel = max(2.8, fontsize / 72 * 1.6 * T + fontsize / 72 * 0.65 * longest)  # rows of text, plus labels
    fig, axes = plt.subplots(nrows, ncols, figsize=(panel * ncols + 1.2, panel * nrows + 0.8),
                             squeeze=False, constrained_layout=True)
    image = None
    for h in range(nrows * ncols):
        ax = axes[h // ncols, h % ncols]
        if h >= H:
            ax.axis("off")
            continue
        image = ax.imshow(maps_HTT[h], cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
        ax.set_title(f"head {h}", fontsize=10)
        ax.set_xticks(range(T))
        ax.set_yticks(range(T))
        ax.set_xticklabels(labels, rotation=90, fontsize=fontsize)
        ax.set_yticklabels(labels, fontsize=fontsize)
        ax.tick_params(length=0)
    fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight")
    fig.suptitle(title or "attention", fontsize=12)
    fig.supxlabel("key (attended to)", fontsize=10)
    fig.supylabel("query (attending)", fontsize=10)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
