"""Classification fine-tuning with seed 001's head: LM logits plus class logits read at a classification token.

GPT-1's recipe: append a classification token to each text, read the final hidden state there through a
new linear head (`GPTClassifier.cls_head`), and train on

    loss = cross_entropy(class logits, label) + lm_weight * next-token loss on the text,

the language-model term acting as a regularizer that keeps the pretrained features (GPT-1 used 0.5).

- Data: a CSV (header with `text` and `label` columns) or JSONL (`{"text": ..., "label": ...}` per line);
  labels are strings or integers, mapped to class ids in sorted order, and the mapping is saved with the
  classifier. Or the built-in `stdlib_packages` task, which needs no download (see `stdlib_packages_task`).
- Encoding: the classification token is appended to the (truncated) text, then rows are left-padded to one
  width, so the token always sits in the last column. Padding is given to the model as a mask, never as a
  pad id, so any token can be the classification token. For GPT-2 BPE models it is the end-of-text token
  (50256); character models have no spare token, so the default is "\\n": every code or text vocabulary has
  it, and the model reads the *last* occurrence in a row, which is always the appended one.
- Training is a jitted step over donated state; the batch of step i is a pure function of (seed, i), and
  dropout of fold_in(key, i), so a resumed run replays an uninterrupted one.

Command line:
    python -m jaxgpt.classify --config configs/classify_stdlib.py [--config.key=value ...]

From Python: `predict(workdir, texts) -> labels`, or `load_classifier(workdir).predict(texts)` for repeated use.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import hashlib
import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from ml_collections import ConfigDict, config_dict

from jaxgpt import distributed, sharding
from jaxgpt.checkpoint import Checkpointer, abstract_params, checkpoint_dir, open_checkpoint
from jaxgpt.config import ModelConfig, model_config_from_dict
from jaxgpt.data import stdlib_files, stdlib_root
from jaxgpt.errors import UserError
from jaxgpt.model import GPTClassifier, dummy_tokens
from jaxgpt.optim import OptimConfig, current_lr, make_optimizer
from jaxgpt.tokenizer import GPT2_VOCAB_SIZE, Tokenizer, tokenizer_from_meta
from jaxgpt.trainer import MetricsLog, check_workdir, setup_runtime

Label = int | str
Batch = dict[str, jax.Array]  # x (B, T) int32, mask (B, T) bool, label (B,) int32, weight (B,) float32

BUILTIN_TASKS = ("stdlib_packages",)
STDLIB_PACKAGES = ("asyncio", "email", "unittest", "xml")
SNIPPET_CHARS = 128
SNIPPETS_PER_CLASS = 800
CHAR_CLS_TOKEN = "\n"
TRAIN_EVAL_EXAMPLES = 256  # training accuracy is measured on a fixed, class-spread sample of this size
# Tags appended to the seed so that the split and the batch streams never coincide (SeedSequence pads
# short entropy with zeros, so the tags must be non-zero).
SPLIT_STREAM, BATCH_STREAM = 2, 3


# ----------------------------------------------------------------------------------------------------
# Configuration


def base_config() -> ConfigDict:
    """Every key of a fine-tuning run; config files start here and change what they need."""
    c = ConfigDict()
    c.workdir = ""  # where the classifier's checkpoints, metrics.jsonl and config.json go (required)
    c.init_from = ""  # "workdir:PATH" (a jaxgpt language-model run) or "hf:PATH" (a GPT-2 directory); required
    c.data = "stdlib_packages"  # a built-in task name, or a .csv / .jsonl file of (text, label)
    c.val_fraction = 0.2  # held out for accuracy (stratified by class; whole files for the built-in task)
    c.max_len = config_dict.placeholder(int)  # tokens per row incl. the classification token; None = block_size
    c.cls_token = ""  # text of the classification token; "" = end-of-text for BPE, "\n" for char models
    c.lm_weight = 0.5  # weight of the auxiliary language-model loss (GPT-1: 0.5; 0 disables it)
    c.cls_dropout = 0.1  # dropout on the hidden state before the classification head
    c.seed = 0  # split, batch order, head init and dropout all derive from it
    c.batch_size = 32
    c.steps = 300
    c.optim = ConfigDict(dataclasses.asdict(OptimConfig(lr=3e-4, min_lr=3e-5, warmup_steps=30)))
    c.optim.decay_steps = config_dict.placeholder(int)  # None: steps
    c.log_interval = 10
    c.eval_interval = 100  # also evaluated after the last step
    c.keep_checkpoints = 1  # the last N, plus the best by validation classification loss
    c.resume = True  # continue from the work directory's latest checkpoint when it has one
    c.mesh = ConfigDict(dict(data=-1, fsdp=1, tensor=1))
    c.bpe_file = ""  # GPT-2 ranks file for BPE models when offline (or env JAXGPT_BPE_FILE)
    c.compilation_cache_dir = "~/.cache/jaxgpt/xla"
    return c


def check_config(c: ConfigDict) -> OptimConfig:
    """Reject impossible settings up front, each with the key to change; returns the optimizer config."""
    if not c.workdir:
        raise UserError("config.workdir is empty: pass --config.workdir=DIR (where the classifier is saved)")
    if not c.init_from:
        raise UserError("config.init_from is empty: pass --config.init_from=workdir:PATH (a jaxgpt language model "
                        "run) or hf:PATH (a Hugging Face GPT-2 directory)")
    for key in ("batch_size", "steps", "log_interval", "eval_interval", "keep_checkpoints"):
        if c[key] < 1:
            raise UserError(f"config.{key}={c[key]} must be >= 1")
    if not 0.0 < c.val_fraction < 1.0:
        raise UserError(f"config.val_fraction={c.val_fraction} must be between 0 and 1 (exclusive), e.g. 0.2")
    if c.lm_weight < 0:
        raise UserError(f"config.lm_weight={c.lm_weight} must be >= 0")
    if not 0.0 <= c.cls_dropout < 1.0:
        raise UserError(f"config.cls_dropout={c.cls_dropout} must be in [0, 1)")
    if c.max_len is not None and c.max_len < 2:
        raise UserError(f"config.max_len={c.max_len} must be >= 2 (at least one text token and the class token)")
    optim = dict(c.optim.to_dict())
    optim["decay_steps"] = optim["decay_steps"] or c.steps
    try:
        return OptimConfig(**optim)
    except TypeError as e:
        raise UserError(f"bad optimizer config: {e}") from None


# ----------------------------------------------------------------------------------------------------
# Labelled data


@dataclasses.dataclass(frozen=True)
class Examples:
    """Texts with their labels as given (strings or ints); `where` names the source in error messages."""

    texts: list[str]
    labels: list[Label]
    where: str = "data"

    def __len__(self) -> int:
        return len(self.texts)


def _check_label(value: Any, where: str) -> Label:
    if isinstance(value, bool) or not isinstance(value, (int, str)) or value == "":
        raise UserError(f"{where}: label {value!r} must be a non-empty string or an integer")
    return value


def read_csv(path: Path) -> Examples:
    """Rows of a CSV with a header naming `text` and `label` (other columns are ignored).

    All CSV values are strings; labels that are all integers ("0", "1", ...) become ints so that they sort
    numerically and come back from `predict` as numbers.
    """
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            columns = reader.fieldnames
            rows = list(reader)
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text (bad byte at offset {e.start}): convert it to UTF-8") from None
    except csv.Error as e:
        raise UserError(f"{path} is not valid CSV ({e})") from None
    if not columns:
        raise UserError(f"{path} is empty: it needs a header line `text,label` and one row per example")
    missing = [name for name in ("text", "label") if name not in columns]
    if missing:
        raise UserError(f"{path} has columns {columns} but lacks {missing}: name the columns `text` and `label`")
    if not rows:
        raise UserError(f"{path} has a header but no rows: add examples")
    texts, labels = [], []
    for line, row in enumerate(rows, start=2):
        if row["text"] is None or row["label"] is None:
            raise UserError(f"{path} row {line} has fewer fields than the header")
        texts.append(row["text"])
        labels.append(_check_label(row["label"].strip(), f"{path} row {line}"))
    if all(label.lstrip("-").isdigit() for label in labels):
        labels = [int(label) for label in labels]
    return Examples(texts, labels, str(path))


def read_jsonl(path: Path) -> Examples:
    """One JSON object per non-blank line with a string `text` and a string or integer `label`."""
    texts, labels = [], []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text (bad byte at offset {e.start}): convert it to UTF-8") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            row = json.loads(line)
        except ValueError as e:
            raise UserError(f"{where} is not valid JSON ({e})") from None
        if not isinstance(row, dict) or "text" not in row or "label" not in row:
            raise UserError(f"{where} must be an object with keys `text` and `label`")
        if not isinstance(row["text"], str):
            raise UserError(f"{where}: text must be a string, got {type(row['text']).__name__}")
        texts.append(row["text"])
        labels.append(_check_label(row["label"], where))
    if not texts:
        raise UserError(f"{path} is empty: it needs one JSON object per line with keys `text` and `label`")
    return Examples(texts, labels, str(path))


def read_labelled(path: str | Path) -> Examples:
    """(text, label) examples of a .csv or .jsonl file, chosen by extension."""
    path = Path(path)
    if path.suffix.lower() not in (".csv", ".jsonl"):
        raise UserError(f"data={str(path)!r} is neither a built-in task ({', '.join(BUILTIN_TASKS)}) nor a .csv or "
                        ".jsonl file")
    if not path.is_file():
        raise UserError(f"data file {path} not found: check --config.data")
    return read_csv(path) if path.suffix.lower() == ".csv" else read_jsonl(path)


def label_names(labels: Sequence[Label], where: str = "data") -> list[Label]:
    """The distinct labels in class-id order (sorted: numbers numerically, strings lexicographically)."""
    distinct = set(labels)
    kinds = {type(label) for label in distinct}
    if len(kinds) > 1:
        raise UserError(f"{where} mixes integer and string labels ({sorted(map(repr, distinct))[:6]}): use one kind")
    if len(distinct) < 2:
        raise UserError(f"{where} has a single class ({next(iter(distinct), None)!r}): classification needs at "
                        "least two labels")
    return sorted(distinct)


def label_ids(labels: Sequence[Label], names: Sequence[Label]) -> np.ndarray:
    index = {name: i for i, name in enumerate(names)}
    return np.array([index[label] for label in labels], np.int32)


def _permutation(entropy: list[int], n: int) -> np.ndarray:
    """A permutation of range(n) from PCG64's raw stream, which NumPy keeps stable across releases."""
    if entropy[0] < 0:
        raise UserError(f"seed {entropy[0]} is negative: use a seed >= 0")
    return np.argsort(np.random.PCG64(entropy).random_raw(n), kind="stable")


def stratified_split(ids: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) example indices holding out `val_fraction` of every class, so the held-out class balance
    (and hence the majority baseline) matches the data's; a class keeps at least one training example."""
    train, val = [], []
    for k in np.unique(ids):
        members = np.flatnonzero(ids == k)
        members = members[_permutation([seed, SPLIT_STREAM, int(k)], len(members))]
        n_val = min(round(val_fraction * len(members)), len(members) - 1)
        val.append(members[:n_val])
        train.append(members[n_val:])
    train_idx, val_idx = np.sort(np.concatenate(train)), np.sort(np.concatenate(val))
    if len(val_idx) == 0:
        raise UserError(f"too few examples ({len(ids)}) to hold out {val_fraction:.0%} for validation: "
                        "add examples or raise config.val_fraction")
    return train_idx, val_idx


# ----------------------------------------------------------------------------------------------------
# The built-in task: which standard-library package does a snippet of source come from?


def _snippets(text: str, length: int) -> list[str]:
    """Non-overlapping `length`-character pieces that start at line starts (so they read like code), except
    those that are mostly blank."""
    out, start = [], 0
    while start + length <= len(text):
        piece = text[start:start + length]
        if sum(not ch.isspace() for ch in piece) >= length // 2:
            out.append(piece)
        next_line = text.find("\n", start + length - 1)
        if next_line < 0:
            break
        start = next_line + 1
    return out


def _held_out_files(sizes: dict[str, int], val_fraction: float) -> set[str]:
    """Whole files for validation, about `val_fraction` of the package's characters. The order is a hash of
    the path, not of the run seed, so the task is the same for every run."""
    order = sorted(sizes, key=lambda rel: hashlib.sha256(rel.encode()).hexdigest())
    target, held, total = val_fraction * sum(sizes.values()), set(), 0
    for rel in order:
        if total >= target:
            break
        if not held or total + sizes[rel] <= 2 * target:  # skip a file that would overshoot by far
            held.add(rel)
            total += sizes[rel]
    return held


def _spread(items: list[str], k: int) -> list[str]:
    """`k` items evenly spaced through `items`, so every file contributes in proportion to its size."""
    return [items[i * len(items) // k] for i in range(k)]


def stdlib_packages_task(val_fraction: float = 0.2, root: Path | None = None, packages: Sequence[str] = STDLIB_PACKAGES,
                         per_class: int = SNIPPETS_PER_CLASS, length: int = SNIPPET_CHARS,
                         ) -> tuple[Examples, Examples, str]:
    """(train, val, description): `length`-character snippets of the interpreter's own standard library,
    labelled by the package they come from (asyncio / email / unittest / xml by default).

    Why this task: it needs no download, is deterministic for a given Python, and is learnable by a
    character model pretrained on `stdlib_char` (each package has its own vocabulary: loops and futures,
    headers and charsets, assertions and mocks, nodes and elements), yet not trivial from 128 characters.
    Classes are balanced (the majority baseline is 1/K), and validation snippets come from files that no
    training snippet comes from, so held-out accuracy measures recognizing a package's style, not a file.
    The language model itself was pretrained on all of these files: what is held out is the labels.
    """
    root = root or stdlib_root()
    pools: dict[str, tuple[list[str], list[str]]] = {}
    for package in packages:
        texts = {}
        for rel in (f"{package}/{f}" for f in stdlib_files(root / package)) if (root / package).is_dir() else ():
            try:
                texts[rel] = (root / rel).read_bytes().decode("utf-8")
            except UnicodeDecodeError:
                continue
        if not texts:
            raise UserError(f"the standard library at {root} has no package {package!r}: the built-in task "
                            "needs its sources; use a CSV or JSONL file instead")
        held = _held_out_files({rel: len(t) for rel, t in texts.items()}, val_fraction)
        snippets = {rel: _snippets(texts[rel], length) for rel in sorted(texts)}
        pools[package] = ([s for rel, ss in snippets.items() if rel not in held for s in ss],
                          [s for rel, ss in snippets.items() if rel in held for s in ss])
    n_val = min(round(per_class * val_fraction), *(len(v) for _, v in pools.values()))
    n_train = min(per_class - n_val, *(len(t) for t, _ in pools.values()))
    if n_val < 1 or n_train < 1:
        raise UserError(f"the standard library at {root} is too small for the built-in task at val_fraction "
                        f"{val_fraction}: use a CSV or JSONL file")
    splits = [Examples([s for p in packages for s in _spread(pools[p][i], n)],
                       [p for p in packages for _ in range(n)], f"stdlib_packages ({name})")
              for i, (n, name) in enumerate(((n_train, "train"), (n_val, "val")))]
    description = (f"stdlib_packages: {length}-character snippets of Python {sys.version.split()[0]}'s "
                   f"{', '.join(packages)} sources at {root}; {n_train} train + {n_val} val per class, "
                   "validation files disjoint from training files")
    return splits[0], splits[1], description


def load_task(c: ConfigDict) -> tuple[Examples, Examples, list[Label], str]:
    """(train, val, label names, description) for config.data: a built-in task or a file."""
    if c.data in BUILTIN_TASKS:
        train, val, description = stdlib_packages_task(c.val_fraction)
        return train, val, label_names(train.labels + val.labels), description
    examples = read_labelled(c.data)
    names = label_names(examples.labels, examples.where)
    train_idx, val_idx = stratified_split(label_ids(examples.labels, names), c.val_fraction, c.seed)
    pick = lambda idx, part: Examples([examples.texts[i] for i in idx], [examples.labels[i] for i in idx],
                                      f"{examples.where} ({part})")
    description = f"{examples.where}: {len(examples)} examples, {len(names)} classes"
    return pick(train_idx, "train"), pick(val_idx, "val"), names, description


# ----------------------------------------------------------------------------------------------------
# Tokens


def cls_token_id(tokenizer: Tokenizer, cls_token: str = "") -> int:
    """The classification token: config.cls_token if given, else end-of-text (BPE) or "\\n" (char models)."""
    if not cls_token:
        if tokenizer.eot_token is not None:
            return tokenizer.eot_token
        cls_token = CHAR_CLS_TOKEN
    try:
        ids = tokenizer.encode(cls_token)
    except UserError:
        ids = []
    if len(ids) != 1:
        raise UserError(f"cls_token {cls_token!r} is not a single token of this model's vocabulary: set "
                        "--config.cls_token to one character (char models) or token (BPE) the model knows")
    return ids[0]


def tokenize(texts: Sequence[str], tokenizer: Tokenizer, where: str = "data") -> list[np.ndarray]:
    """Token ids of each text; an untokenizable text (a character outside a char vocabulary) names its index."""
    rows = []
    for i, text in enumerate(texts):
        try:
            rows.append(tokenizer.encode_array(text))
        except UserError as e:
            raise UserError(f"{where} example {i} ({text[:40]!r}): {e}") from None
    return rows


def pad_rows(rows: Sequence[np.ndarray], cls_id: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Token rows -> (x (N, W) int32, mask (N, W) bool): each row's first W-1 tokens plus the classification
    token, left-padded (mask False) so that the classification token sits in the last column.

    Left padding shifts a text's absolute positions by W - length, so `predict` must reuse the W of
    fine-tuning (saved as `max_len` in the checkpoint's meta).
    """
    x = np.zeros((len(rows), width), np.int32)
    mask = np.zeros((len(rows), width), bool)
    for i, r in enumerate(rows):
        r = np.append(r[:width - 1], cls_id)
        x[i, width - len(r):], mask[i, width - len(r):] = r, True
    return x, mask


def encode_texts(texts: Sequence[str], tokenizer: Tokenizer, cls_id: int, width: int,
                 where: str = "data") -> tuple[np.ndarray, np.ndarray]:
    return pad_rows(tokenize(texts, tokenizer, where), cls_id, width)


# ----------------------------------------------------------------------------------------------------
# Batches


def batch_indices(seed: int, step: int, n: int, batch_size: int) -> np.ndarray:
    """Example indices of the training batch of `step`: consecutive slices of one shuffle per epoch, a pure
    function of (seed, step), so every example is seen once per epoch and a resumed run sees the same ones."""
    positions = step * batch_size + np.arange(batch_size)
    epochs, offsets = positions // n, positions % n
    out = np.empty(batch_size, np.int64)
    for epoch in np.unique(epochs):
        sel = epochs == epoch
        out[sel] = _permutation([seed, BATCH_STREAM, int(epoch)], n)[offsets[sel]]
    return out


def make_batch(data: dict[str, np.ndarray], idx: np.ndarray, n_real: int | None = None) -> dict[str, np.ndarray]:
    """Rows `idx` of the encoded data; rows past `n_real` are filler with weight 0 (a short last eval batch)."""
    weight = np.ones(len(idx), np.float32)
    if n_real is not None:
        weight[n_real:] = 0.0
    return {"x": data["x"][idx], "mask": data["mask"][idx], "label": data["label"][idx], "weight": weight}


def eval_batches(data: dict[str, np.ndarray], batch_size: int,
                 idx: np.ndarray | None = None) -> list[dict[str, np.ndarray]]:
    """Examples `idx` (default all) in fixed-shape batches; the last one is padded with zero-weight rows."""
    idx = np.arange(len(data["x"])) if idx is None else idx
    return [make_batch(data, np.resize(idx[i:i + batch_size], batch_size), len(idx[i:i + batch_size]))
            for i in range(0, len(idx), batch_size)]


def spread_indices(n: int, k: int) -> np.ndarray:
    """min(n, k) distinct indices evenly spaced over range(n): a sample of a class-ordered set that keeps
    every class (the built-in task lists its examples class by class)."""
    return np.unique(np.linspace(0, n - 1, min(n, k)).round().astype(np.int64))


# ----------------------------------------------------------------------------------------------------
# Loss and compiled steps


def classification_loss(lm_logits_BTV: jax.Array, cls_logits_BK: jax.Array, batch: Batch,
                         lm_weight: float) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Seed 001 / GPT-1 fine-tuning loss: class cross-entropy + lm_weight * next-token cross-entropy.

    Both are means over real items: the class term over rows (weighted, so filler rows count nothing), the
    language-model term over text tokens that predict a following text token; padding and the appended
    classification token (which is not part of the text) are never targets.
    """
    w_B = batch["weight"]
    cls_B = optax.softmax_cross_entropy_with_integer_labels(cls_logits_BK, batch["label"])
    cls_loss = jnp.sum(cls_B * w_B) / jnp.maximum(jnp.sum(w_B), 1.0)
    # Position t predicts t+1 for t < T-2: the last column holds the classification token, never a target.
    mask_BT = batch["mask"]
    target_BT = mask_BT[:, :-2] & mask_BT[:, 1:-1]
    tok_BT = optax.softmax_cross_entropy_with_integer_labels(lm_logits_BTV[:, :-2], batch["x"][:, 1:-1])
    tok_w_BT = target_BT * w_B[:, None]
    lm_loss = jnp.sum(tok_BT * tok_w_BT) / jnp.maximum(jnp.sum(tok_w_BT), 1.0)
    return cls_loss + lm_weight * lm_loss, {"cls_loss": cls_loss, "lm_loss": lm_loss}


def make_train_step(model: GPTClassifier, tx: optax.GradientTransformation,
                    lm_weight: float) -> Callable[[dict, Batch, jax.Array], tuple[dict, dict]]:
    """`train_step(state, batch, key) -> (state, metrics)` over the plain-dict state of `jaxgpt.train_step`."""

    def loss_fn(params: Any, batch: Batch, key: jax.Array) -> tuple[jax.Array, dict]:
        lm, cls = model.apply({"params": params}, batch["x"], batch["mask"], deterministic=False,
                              rngs={"dropout": key})
        return classification_loss(lm, cls, batch, lm_weight)

    def train_step(state: dict, batch: Batch, key: jax.Array) -> tuple[dict, dict]:
        (loss, parts), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state["params"], batch, jax.random.fold_in(key, state["step"]))
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": loss, **parts, "grad_norm": optax.tree.norm(grads), "lr": current_lr(opt_state)}
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    return train_step


def make_eval_step(model: GPTClassifier, lm_weight: float) -> Callable[[Any, Batch], dict[str, jax.Array]]:
    """Weighted sums for one batch (dropout off), so batches of any fill combine exactly, plus predictions."""

    def eval_step(params: Any, batch: Batch) -> dict[str, jax.Array]:
        lm, cls = model.apply({"params": params}, batch["x"], batch["mask"])
        _, parts = classification_loss(lm, cls, batch, lm_weight)
        n = jnp.sum(batch["weight"])
        pred_B = jnp.argmax(cls, axis=-1)
        return {"n": n, "correct": jnp.sum((pred_B == batch["label"]) * batch["weight"]),
                "cls_loss": parts["cls_loss"] * n, "lm_loss": parts["lm_loss"] * n, "pred": pred_B}

    return eval_step


def summarize(outputs: list[dict[str, Any]], labels: np.ndarray) -> dict[str, Any]:
    """Accuracy, mean losses and per-class accuracy from `eval_step` outputs over one data set."""
    n = sum(float(o["n"]) for o in outputs)
    pred = np.concatenate([np.asarray(o["pred"]) for o in outputs])[:len(labels)]
    per_class = {int(k): float(np.mean(pred[labels == k] == k)) for k in np.unique(labels)}
    return {"accuracy": sum(float(o["correct"]) for o in outputs) / n,
            "cls_loss": sum(float(o["cls_loss"]) for o in outputs) / n,
            "lm_loss": sum(float(o["lm_loss"]) for o in outputs) / n, "per_class": per_class}


def majority_baseline(train_ids: np.ndarray, val_ids: np.ndarray) -> tuple[int, float]:
    """(class, held-out accuracy) of always predicting the training set's most frequent class."""
    majority = Counter(train_ids.tolist()).most_common(1)[0][0]
    return majority, float(np.mean(val_ids == majority))


# ----------------------------------------------------------------------------------------------------
# Models


def load_language_model(spec: str, bpe_file: str = "", max_len: int | None = None) -> tuple[Any, ModelConfig, dict]:
    """(params, config, tokenizer meta) of the language model to fine-tune: `workdir:PATH` or `hf:PATH`."""
    kind, _, path = spec.partition(":")
    if kind == "workdir" and path:
        from jaxgpt.checkpoint import load_for_inference

        if not Path(path).is_dir():
            raise UserError(f"init_from {spec}: {path} does not exist: train a language model first "
                            f"(python train.py --config configs/stdlib_char.py --config.workdir={path})")
        if _is_classifier_run(path):  # fine-tune a fine-tuned model again: keep its body, drop its head
            clf = load_classifier(path, bpe_file=bpe_file or None)
            params = {k: v for k, v in clf.params.items() if k != "cls_head"}
            return params, clf.model.cfg, clf.tokenizer.to_meta()
        params, cfg, meta = load_for_inference(path)
        return params, cfg, meta["tokenizer"]
    if kind == "hf" and path:
        from jaxgpt.hf import load_hf_gpt2, read_hf_config

        n_positions = read_hf_config(path).get("n_positions", 1024)
        params, cfg = load_hf_gpt2(path, block_size=min(max_len or n_positions, n_positions))
        if cfg.vocab_size != GPT2_VOCAB_SIZE:
            raise UserError(f"init_from {spec} has a {cfg.vocab_size}-token vocabulary, not GPT-2's {GPT2_VOCAB_SIZE}: "
                            "jaxgpt has no tokenizer for it")
        return params, cfg, {"type": "bpe", "encoding": "gpt2", "vocab_size": GPT2_VOCAB_SIZE}
    raise UserError(f"init_from={spec!r} is not understood: use workdir:PATH (a jaxgpt language model run) or "
                    "hf:PATH (a Hugging Face GPT-2 directory)")


def _is_classifier_run(workdir: str | Path) -> bool:
    if not checkpoint_dir(workdir).is_dir():
        return False
    ckpt = Checkpointer(workdir, read_only=True)
    try:
        step = ckpt.latest_step()
        return step is not None and "classifier" in ckpt.read_meta(step)
    finally:
        ckpt.close()


def classifier_params(model: GPTClassifier, lm_params: Any, key: jax.Array, abstract: Any) -> Any:
    """The language model's parameters plus a freshly initialized `cls_head` (the only new subtree), placed
    as `abstract` (the classifier's ShapeDtypeStructs with shardings) says.

    Only the head's init is kept, so XLA drops the rest of the (discarded) full initialization.
    """
    dummy = dummy_tokens(model.cfg)
    head = jax.jit(lambda k: nn.unbox(model.init(k, dummy)["params"]["cls_head"]))(key)
    params = {**lm_params, "cls_head": head}
    if jax.tree.map(lambda s: s.shape, abstract) != jax.tree.map(lambda a: a.shape, params):
        raise UserError("the language model's parameters do not match its own config (corrupt checkpoint?)")
    return jax.device_put(params, jax.tree.map(lambda s: s.sharding, abstract))


# ----------------------------------------------------------------------------------------------------
# Fine-tuning


@dataclasses.dataclass(frozen=True)
class EncodedTask:
    """A task ready for the model: token arrays per split, the label names, and the row width W."""

    data: dict[str, dict[str, np.ndarray]]  # split -> {"x" (N, W), "mask" (N, W), "label" (N,)}
    names: list[Label]
    width: int
    description: str


def encode_task(task: tuple[Examples, Examples, list[Label], str], tokenizer: Tokenizer, cls_id: int,
                max_len: int | None, block_size: int) -> EncodedTask:
    """Tokenize `load_task`'s examples and pad every row to one width: the longest row, at most max_len."""
    train_ex, val_ex, names, description = task
    max_len = max_len or block_size
    if max_len > block_size:
        raise UserError(f"config.max_len={max_len} exceeds the model's block_size {block_size}: lower it")
    parts = {"train": train_ex, "val": val_ex}
    tokens = {part: tokenize(ex.texts, tokenizer, ex.where) for part, ex in parts.items()}
    width = min(max_len, 1 + max(len(r) for rows in tokens.values() for r in rows))  # no wider than needed
    data = {}
    for part, ex in parts.items():
        x, mask = pad_rows(tokens[part], cls_id, width)
        data[part] = {"x": x, "mask": mask, "label": label_ids(ex.labels, names)}
    return EncodedTask(data, names, width, description)


@dataclasses.dataclass(frozen=True)
class Program:
    """How the classifier's state and batches lie on the device mesh, and the compiled steps over them."""

    mesh: Any
    rules: Any
    abstract_state: dict[str, Any]  # ShapeDtypeStructs with shardings
    state_sh: dict[str, Any]
    batch_sh: dict[str, Any]
    train_step: Callable[..., Any]  # jitted (state, batch, key) -> (state, metrics); donates state
    eval_step: Callable[..., Any]  # jitted (params, batch) -> sums and predictions


def build_program(c: ConfigDict, model: GPTClassifier, tx: optax.GradientTransformation) -> Program:
    """The language-model trainer's layout (`jaxgpt.distributed`) for the classifier: parameters by their
    logical axis names, optimizer moments with their parameters, batch rows over data x fsdp."""
    cfg = model.cfg
    mesh = sharding.make_mesh((c.mesh.data, c.mesh.fsdp, c.mesh.tensor))
    sharding.check_divisibility(cfg, mesh, c.batch_size)
    rules = sharding.rules_for(cfg, mesh)
    param_sh, state_sh, abstract_state = distributed.state_layout(model, cfg, tx, mesh, rules)
    repl = state_sh["step"]
    rows = sharding.batch_sharding(mesh)
    batch_sh = {"x": rows, "mask": rows, "label": sharding.batch_sharding(mesh, 1),
                "weight": sharding.batch_sharding(mesh, 1)}
    train_step = jax.jit(make_train_step(model, tx, c.lm_weight), in_shardings=(state_sh, batch_sh, repl),
                         out_shardings=(state_sh, repl), donate_argnums=(0,))
    eval_step = jax.jit(make_eval_step(model, c.lm_weight), in_shardings=(param_sh, batch_sh), out_shardings=repl)
    return Program(mesh, rules, abstract_state, state_sh, batch_sh, train_step, eval_step)


def finetune(c: ConfigDict) -> dict[str, Any]:
    """Fine-tune (or resume) as configured, save the classifier, and return the final held-out metrics."""
    optim_cfg = check_config(c)
    _compile_cache(c)
    examples = load_task(c)  # bad data fails before a large model is read
    lm_params, cfg, tok_meta = load_language_model(c.init_from, c.bpe_file, c.max_len)
    tokenizer = tokenizer_from_meta(tok_meta, c.bpe_file or None)
    cls_id = cls_token_id(tokenizer, c.cls_token)
    task = encode_task(examples, tokenizer, cls_id, c.max_len, cfg.block_size)
    data, names = task.data, task.names
    n_train, n_val = len(data["train"]["x"]), len(data["val"]["x"])
    majority, baseline = majority_baseline(data["train"]["label"], data["val"]["label"])
    workdir = check_workdir(c.workdir)
    print(f"{task.description}\n{len(names)} classes {names}; {n_train} train / {n_val} held-out examples, "
          f"{task.width} tokens per row; majority-class baseline {baseline:.3f} ({names[majority]!r})", flush=True)

    model = GPTClassifier(cfg, n_class=len(names), cls_token_id=cls_id, cls_dropout=c.cls_dropout)
    tx = make_optimizer(optim_cfg)
    prog = build_program(c, model, tx)
    head_key, dropout_key = jax.random.split(jax.random.key(c.seed))
    meta = {"model": cfg.to_dict(), "tokenizer": tok_meta, "config": json.loads(c.to_json()),
            "classifier": {"labels": names, "n_class": len(names), "cls_token_id": cls_id, "max_len": task.width,
                           "cls_dropout": c.cls_dropout, "lm_weight": c.lm_weight, "init_from": c.init_from,
                           "data": task.description, "majority_baseline": baseline}}
    put = lambda b: jax.device_put(b, prog.batch_sh)
    eval_idx = {"val": np.arange(n_val), "train": spread_indices(n_train, min(n_val, TRAIN_EVAL_EXAMPLES))}
    ckpt = Checkpointer(workdir, keep=c.keep_checkpoints)
    with jax.set_mesh(prog.mesh), nn.logical_axis_rules(prog.rules):
        state, start = _initial_state(c, ckpt, meta, model, tx, lm_params, prog, head_key)
        (workdir / "config.json").write_text(json.dumps(meta["config"], indent=2) + "\n")
        evals = {part: [put(b) for b in eval_batches(data[part], c.batch_size, idx)] for part, idx in eval_idx.items()}

        def evaluate(params: Any) -> dict[str, Any]:
            return {part: summarize(jax.device_get([prog.eval_step(params, b) for b in batches]),
                                    data[part]["label"][eval_idx[part]]) for part, batches in evals.items()}

        def batch(step: int) -> Batch:
            return put(make_batch(data["train"], batch_indices(c.seed, step, n_train, c.batch_size)))

        t0 = time.perf_counter()
        compiled = prog.train_step.lower(state, batch(start), dropout_key).compile() if start < c.steps else None
        compile_s = time.perf_counter() - t0
        log = MetricsLog(workdir, start)
        result: dict[str, Any] = {}
        t_train, t_eval, t_last = 0.0, 0.0, time.perf_counter()
        try:
            for step in range(start, c.steps):
                state, metrics = compiled(state, batch(step), dropout_key)
                done = step + 1
                is_eval = done % c.eval_interval == 0 or done == c.steps
                if done % c.log_interval == 0 or is_eval:
                    m = {k: float(v) for k, v in jax.device_get(metrics).items()}
                    if not np.isfinite(m["loss"]):
                        raise UserError(f"loss is {m['loss']} at step {done}: lower optim.lr")
                    log.write(done, {"train_loss": m["loss"], "train_cls_loss": m["cls_loss"],
                                     "train_lm_loss": m["lm_loss"], "lr": m["lr"], "grad_norm": m["grad_norm"]})
                if is_eval:
                    now = time.perf_counter()
                    t_train += now - t_last
                    result = evaluate(state["params"])
                    val, tr = result["val"], result["train"]
                    log.write(done, {"val_accuracy": val["accuracy"], "val_cls_loss": val["cls_loss"],
                                     "val_lm_loss": val["lm_loss"], "train_accuracy": tr["accuracy"],
                                     "majority_baseline": baseline})
                    print(f"step {done}: held-out accuracy {val['accuracy']:.3f} (majority baseline {baseline:.3f}), "
                          f"val cls loss {val['cls_loss']:.4f}, val LM loss {val['lm_loss']:.4f}; train accuracy "
                          f"{tr['accuracy']:.3f}, train loss {m['loss']:.4f}", flush=True)
                    ckpt.save(state, {**meta, "val_loss": val["cls_loss"], "val_accuracy": val["accuracy"]})
                    t_last = time.perf_counter()
                    t_eval += t_last - now
        finally:  # a save in flight must commit even when fine-tuning stops early
            ckpt.wait()
            ckpt.close()
            log.close()
    steps_run = c.steps - start
    if result:
        per_class = ", ".join(f"{names[k]}: {a:.2f}" for k, a in result["val"]["per_class"].items())
        print(f"done: held-out accuracy {result['val']['accuracy']:.3f} vs majority baseline {baseline:.3f} on "
              f"{n_val} examples (per class: {per_class}); {steps_run} steps in {t_train:.1f} s "
              f"(+ compile {compile_s:.1f} s, eval {t_eval:.1f} s); classifier saved in {workdir}", flush=True)
    return {**result, "majority_baseline": baseline, "labels": names, "train_seconds": t_train,
            "compile_seconds": compile_s, "eval_seconds": t_eval, "steps": steps_run}


def _compile_cache(c: ConfigDict) -> None:
    """The persistent XLA cache, as the language-model trainer sets it (no multi-host setup here)."""
    setup_runtime(ConfigDict({"compilation_cache_dir": c.compilation_cache_dir,
                              "distributed": {"enabled": False}}))


def _initial_state(c: ConfigDict, ckpt: Checkpointer, meta: dict, model: GPTClassifier, tx: Any, lm_params: Any,
                   prog: Program, key: jax.Array) -> tuple[dict, int]:
    """Resume from the latest classifier checkpoint of this run, or start from the language model."""
    latest = ckpt.latest_step()
    if latest is not None:
        if not c.resume:
            raise UserError(f"{c.workdir} already holds checkpoints (latest step {latest}): pass "
                            "--config.resume=True to continue, or choose a new --config.workdir")
        saved = ckpt.read_meta(latest)
        keys = ("labels", "cls_token_id", "max_len")
        if saved.get("model") != meta["model"] or any(saved.get("classifier", {}).get(k) != meta["classifier"][k]
                                                      for k in keys):
            raise UserError(f"{c.workdir} holds a classifier with a different model, labels, class token or "
                            "row width: choose a new --config.workdir")
        state = ckpt.restore(latest, prog.abstract_state)
        print(f"resuming at step {latest}", flush=True)
        return state, latest
    params = classifier_params(model, lm_params, key, prog.abstract_state["params"])
    opt_state = jax.jit(tx.init, out_shardings=prog.state_sh["opt_state"])(params)
    return {"params": params, "opt_state": opt_state,
            "step": jax.device_put(jnp.zeros((), jnp.int32), prog.state_sh["step"])}, 0


# ----------------------------------------------------------------------------------------------------
# Prediction


@dataclasses.dataclass(frozen=True, eq=False)
class Classifier:
    """A loaded classifier: `predict(texts)` returns labels as they were given in the training data."""

    params: Any
    model: GPTClassifier
    tokenizer: Tokenizer
    labels: list[Label]
    width: int

    @functools.cached_property
    def _cls_logits(self) -> Callable[[Any, np.ndarray, np.ndarray], jax.Array]:
        return jax.jit(lambda p, x, m: self.model.apply({"params": p}, x, m)[1])

    def logits(self, texts: Sequence[str], batch_size: int = 64) -> np.ndarray:
        """Class logits (N, K), in batches of one fixed shape (one compilation)."""
        x, mask = encode_texts(texts, self.tokenizer, self.model.cls_token_id, self.width, "texts")
        out = []
        for start in range(0, len(x), batch_size):
            idx = np.resize(np.arange(start, min(start + batch_size, len(x))), batch_size)
            out.append(np.asarray(self._cls_logits(self.params, x[idx], mask[idx]))[:min(batch_size, len(x) - start)])
        return np.concatenate(out) if out else np.zeros((0, len(self.labels)), np.float32)

    def predict(self, texts: Sequence[str], batch_size: int = 64) -> list[Label]:
        return [self.labels[k] for k in self.logits(texts, batch_size).argmax(-1)]


def load_classifier(workdir: str | Path, which: str = "latest", bpe_file: str | None = None) -> Classifier:
    """The classifier saved by `finetune` in `workdir` (its latest, or best by validation loss, checkpoint)."""
    ckpt, step, meta = open_checkpoint(workdir, which, "fine-tune first (python -m jaxgpt.classify --config ... "
                                       f"--config.workdir={workdir})")
    try:
        if "classifier" not in meta:
            raise UserError(f"{workdir} holds a language model, not a classifier: fine-tune it with "
                            "python -m jaxgpt.classify")
        info, cfg = meta["classifier"], model_config_from_dict(meta["model"])
        model = GPTClassifier(cfg, n_class=info["n_class"], cls_token_id=info["cls_token_id"],
                              cls_dropout=info["cls_dropout"])
        params = ckpt.restore_params(step, abstract_params(model, cfg))
    finally:
        ckpt.close()
    return Classifier(params, model, tokenizer_from_meta(meta["tokenizer"], bpe_file), info["labels"], info["max_len"])


def predict(workdir: str | Path, texts: Sequence[str], which: str = "latest") -> list[Label]:
    """Labels of `texts` from the classifier saved in `workdir`."""
    return load_classifier(workdir, which).predict(texts)


# ----------------------------------------------------------------------------------------------------
# Command line


def main() -> None:
    """python -m jaxgpt.classify --config configs/classify_stdlib.py [--config.key=value ...]"""
    from jaxgpt.cli import run_config_command

    run_config_command(finetune, example="configs/classify_stdlib.py", keys_in="jaxgpt/classify.py")


if __name__ == "__main__":
    from jaxgpt.cli import use_huge_pages

    use_huge_pages()
    main()
