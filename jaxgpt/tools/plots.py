"""Pictures: training curves from metrics.jsonl, attention heatmaps for a prompt, sinusoidal position codes.

Each figure has a data function (plain numpy, testable without looking at pixels) and a drawing
function that only lays the numbers out. Drawing uses matplotlib's Agg backend, so no display is needed.
The command line is `jaxgpt plots curves ...` / `jaxgpt plots attention ...` / `jaxgpt plots positions ...`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxgpt import storage
from jaxgpt.errors import UserError
from jaxgpt.model.config import ModelConfig, Seq2SeqConfig
from jaxgpt.train.rundir import METRICS_FILE

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
    path = storage.location(workdir, "--workdir") / METRICS_FILE
    with storage.guard(path, "reading"):
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
    return _save(plt, fig, out)


# ---------------------------------------------------------------------------------------------------
# Attention heatmaps


def attention_maps(params: Any, cfg: ModelConfig, ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Attention probabilities (L, H, T, T) of one token sequence: row t is query t's weights over keys.

    They come from the weights the model sows into `intermediates`, which only the einsum attention
    path computes explicitly, so that path is forced here; it gives the same outputs as the fused ones.
    """
    import jax
    import jax.numpy as jnp

    from jaxgpt.model.gpt import GPT

    ids = checked_ids(ids, cfg.vocab_size, cfg.block_size, "the prompt")
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


def checked_ids(ids: Sequence[int] | np.ndarray, vocab_size: int, max_len: int, what: str) -> np.ndarray:
    """`ids` as int32, or a UserError saying why the model cannot read them."""
    ids = np.asarray(ids, dtype=np.int32).reshape(-1)
    if ids.size == 0:
        raise UserError(f"{what} is empty: give at least one token")
    if ids.size > max_len:
        raise UserError(f"{what} has {ids.size} tokens but the model sees at most {max_len}: shorten it")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise UserError(f"token ids must be in [0, {vocab_size}), got {ids.min()}..{ids.max()}")
    return ids


def seq2seq_attention_maps(params: Any, cfg: Seq2SeqConfig, src_ids: Sequence[int] | np.ndarray,
                           tgt_ids: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
    """An encoder-decoder's attention for one (source, target) pair, from the weights its modules sow.

    {"encoder": (L_enc, H, S, S) source self-attention, "decoder": (L, H, T, T) causal target self-attention,
    "cross": (L, H, T, S) each target position over the source}; as for the GPT, on the einsum path.
    """
    import jax
    import jax.numpy as jnp

    from jaxgpt.model.encdec import Seq2SeqModel

    src = checked_ids(src_ids, cfg.src_vocab_size, cfg.src_block_size, "the source")
    tgt = checked_ids(tgt_ids, cfg.model.vocab_size, cfg.model.block_size, "the target")
    model = Seq2SeqModel(cfg.replace(attention_impl="einsum"))

    @jax.jit
    def sown(p: Any, src_BS: jax.Array, tgt_BT: jax.Array) -> Any:
        _, state = model.apply({"params": p}, src_BS, tgt_BT, mutable=["intermediates"])
        return state["intermediates"]

    inter = sown(params, jnp.asarray(src)[None], jnp.asarray(tgt)[None])
    stack = lambda prefix, n, module: np.stack(
        [np.asarray(inter[f"{prefix}_{i}"][module]["attn_weights"][0])[0] for i in range(n)]).astype(np.float64)
    return {"encoder": stack("enc", cfg.n_encoder_layer, "attn"), "decoder": stack("dec", cfg.model.n_layer, "attn"),
            "cross": stack("dec", cfg.model.n_layer, "cross")}


def visible_token(text: str) -> str:
    """A token's text as an axis label: whitespace made visible, so ' the' and 'the' differ on the plot."""
    shown = text.replace("\n", "↵").replace("\t", "⇥").replace("\r", "␍").replace(" ", "·")
    return shown if shown else "∅"


def token_labels(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """One label per token, decoded one id at a time (a token that is part of a UTF-8 character shows �)."""
    return [visible_token(tokenizer.decode([int(i)])) for i in ids]


Panel = tuple[str, np.ndarray, Sequence[str], Sequence[str]]  # (title, (T, S) weights, query labels, key labels)


def plot_attention(maps_HTT: np.ndarray, labels: Sequence[str], out: str | os.PathLike[str], title: str = "") -> Path:
    """A near-square grid of heatmaps, one per head (4 heads 2x2, 12 heads 4x3)."""
    H = maps_HTT.shape[0]
    panels = [(f"head {h}", maps_HTT[h], labels, labels) for h in range(H)]
    return plot_attention_panels(panels, math.ceil(math.sqrt(H)), out, title)


def seq2seq_panels(maps: dict[str, np.ndarray], layer: int, src_labels: Sequence[str],
                   tgt_labels: Sequence[str]) -> list[Panel]:
    """One row per attention of an encoder-decoder layer (encoder self, decoder self, cross), one column per head."""
    rows = [("encoder", src_labels, src_labels), ("decoder", tgt_labels, tgt_labels), ("cross", tgt_labels, src_labels)]
    return [(f"{kind} head {h}", maps[kind][layer, h], queries, keys)
            for kind, queries, keys in rows for h in range(maps[kind].shape[1])]


def plot_attention_panels(panels: Sequence[Panel], ncols: int, out: str | os.PathLike[str], title: str = "") -> Path:
    """Heatmaps in rows of `ncols`, sharing a 0..1 color scale; queries down, keys across."""
    plt = _pyplot()
    for name, map_TS, queries, keys in panels:
        if map_TS.shape != (len(queries), len(keys)):
            raise ValueError(f"{name}: {len(queries)} x {len(keys)} labels for a {map_TS.shape} map")
    nrows = math.ceil(len(panels) / ncols)
    longest = max(len(label) for _, _, queries, keys in panels for label in (*queries, *keys))
    T = max(max(map_TS.shape) for _, map_TS, _, _ in panels)
    fontsize = 9 if T <= 32 else 7 if T <= 64 else 5
    panel = max(2.8, fontsize / 72 * 1.6 * T + fontsize / 72 * 0.65 * longest)  # rows of text, plus labels
    fig, axes = plt.subplots(nrows, ncols, figsize=(panel * ncols + 1.2, panel * nrows + 0.8),
                             squeeze=False, constrained_layout=True)
    image = None
    for i in range(nrows * ncols):
        ax = axes[i // ncols, i % ncols]
        if i >= len(panels):
            ax.axis("off")
            continue
        name, map_TS, queries, keys = panels[i]
        image = ax.imshow(map_TS, cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
        ax.set_title(name, fontsize=10)
        ax.set_xticks(range(len(keys)))
        ax.set_yticks(range(len(queries)))
        ax.set_xticklabels(keys, rotation=90, fontsize=fontsize)
        ax.set_yticklabels(queries, fontsize=fontsize)
        ax.tick_params(length=0)
    fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight")
    fig.suptitle(title or "attention", fontsize=12)
    fig.supxlabel("key (attended to)", fontsize=10)
    fig.supylabel("query (attending)", fontsize=10)
    return _save(plt, fig, out)


def _save(plt: Any, fig: Any, out: str | os.PathLike[str]) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# ---------------------------------------------------------------------------------------------------
# Sinusoidal position codes

LAYOUTS = ("sinusoidal", "sinusoidal_concat")  # seed 000's interleaved sin/cos, seed 002's [sin..., cos...]


def sinusoid_columns(width: int, layout: str, frequencies: Sequence[int]) -> list[tuple[str, int]]:
    """(label, column) of the sine and the cosine of each frequency index i (angle = pos / 10000^(2i / width)):
    columns 2i and 2i + 1 when interleaved, i and width/2 + i when concatenated."""
    half = width // 2
    bad = [f for f in frequencies if not 0 <= f < half]
    if bad:
        raise UserError(f"frequency indices {bad} do not exist for width {width}: choose from 0..{half - 1}")
    columns = []
    for f in frequencies:
        sin, cos = (2 * f, 2 * f + 1) if layout == "sinusoidal" else (f, half + f)
        columns += [(f"sin, i={f} (dim {sin})", sin), (f"cos, i={f} (dim {cos})", cos)]
    return columns


def position_panels(length: int, width: int, layouts: Sequence[str] = LAYOUTS, frequencies: Sequence[int] = ()
                    ) -> list[tuple[str, np.ndarray, list[tuple[str, int]]]]:
    """Per layout: (layout, the (length, width) table the model adds, the sinusoids to draw over position).

    No frequencies: i = width/32 and width/8, wavelengths of about 11 and 63 positions whatever the width.
    """
    from jaxgpt.model.layers import sinusoidal_table

    if length < 1 or width < 2 or width % 2:
        raise UserError(f"position codes need length >= 1 and an even width >= 2, got length {length}, width {width}")
    frequencies = frequencies or sorted({width // 32, width // 8})
    unknown = [k for k in layouts if k not in LAYOUTS]
    if unknown or not layouts:
        raise UserError(f"unknown position layouts {unknown}: choose from {LAYOUTS}")
    return [(k, sinusoidal_table(length, width, k), sinusoid_columns(width, k, frequencies)) for k in layouts]


def plot_positions(panels: Sequence[tuple[str, np.ndarray, list[tuple[str, int]]]], out: str | os.PathLike[str],
                   title: str = "") -> Path:
    """One row per layout: the code matrix as an image (positions down, dimensions across), then its sinusoids."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(panels), 2, figsize=(13, 4.2 * len(panels) + 0.6), squeeze=False,
                             constrained_layout=True, gridspec_kw={"width_ratios": [1.1, 1]})
    names = {"sinusoidal": "interleaved sin/cos (seed 000)", "sinusoidal_concat": "concatenated [sin, cos] (seed 002)"}
    for (layout, table, columns), (matrix_ax, curve_ax) in zip(panels, axes, strict=True):
        image = matrix_ax.imshow(table, cmap="RdBu", vmin=-1.0, vmax=1.0, aspect="auto", interpolation="nearest")
        matrix_ax.set_title(names[layout], fontsize=11)
        matrix_ax.set_xlabel("dimension")
        matrix_ax.set_ylabel("position")
        fig.colorbar(image, ax=matrix_ax, shrink=0.8)
        for label, column in columns:
            curve_ax.plot(np.arange(len(table)), table[:, column], label=label, lw=1.4)
        curve_ax.set_xlabel("position")
        curve_ax.set_ylabel("value")
        curve_ax.grid(True, alpha=0.3)
        curve_ax.legend(loc="upper right", fontsize=8)
    length, width = panels[0][1].shape
    fig.suptitle(title or f"sinusoidal position codes ({length} positions x {width} dimensions)", fontsize=12)
    return _save(plt, fig, out)
