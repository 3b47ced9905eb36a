"""Labelled text for classification fine-tuning: files, the built-in dataset, tokens, batches.

- Data: a CSV (header with `text` and `label` columns) or JSONL (`{"text": ..., "label": ...}` per line);
  labels are strings or integers, mapped to class ids in sorted order, and the mapping is saved with the
  classifier. Or the built-in `stdlib_packages` task, which needs no download (see `stdlib_packages_task`).
- Encoding: the classification token is appended to the (truncated) text, then rows are left-padded to one
  width, so the token always sits in the last column. Padding is given to the model as a mask, never as a
  pad id, so any token can be the classification token. For GPT-2 BPE models it is the end-of-text token
  (50256); character models have no spare token, so the default is "\\n": every code or text vocabulary has
  it, and the model reads the *last* occurrence in a row, which is always the appended one.
- Batches: the training batch of step i is a pure function of (seed, i) (one shuffle per epoch).
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxgpt.data.batches import permutation
from jaxgpt.data.corpora import stdlib_files, stdlib_root
from jaxgpt.data.streams import SPLIT_STREAM
from jaxgpt.data.tokenizer import Tokenizer
from jaxgpt.data.user_files import jsonl_objects, read_text
from jaxgpt.errors import UserError

Label = int | str

BUILTIN_DATASETS = ("stdlib_packages",)
STDLIB_PACKAGES = ("asyncio", "email", "unittest", "xml")
SNIPPET_CHARS = 128
SNIPPETS_PER_CLASS = 800
CHAR_CLS_TOKEN = "\n"


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
        reader = csv.DictReader(io.StringIO(read_text(path), newline=""))
        columns = reader.fieldnames
        rows = list(reader)
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
    for where, row in jsonl_objects(path):
        if not isinstance(row, dict) or "text" not in row or "label" not in row:
            raise UserError(f"{where}: not an object with keys `text` and `label`")
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
        raise UserError(f"data={str(path)!r} is neither a built-in dataset ({', '.join(BUILTIN_DATASETS)}) nor a "
                        ".csv or .jsonl file")
    if not path.is_file():
        raise UserError(f"data file {path} not found: check --config.classify.data")
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


def stratified_split(ids: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) example indices holding out `val_fraction` of every class, so the held-out class balance
    (and hence the majority baseline) matches the data's; a class keeps at least one training example."""
    train, val = [], []
    for k in np.unique(ids):
        members = np.flatnonzero(ids == k)
        members = members[permutation([seed, SPLIT_STREAM, int(k)], len(members))]
        n_val = min(round(val_fraction * len(members)), len(members) - 1)
        val.append(members[:n_val])
        train.append(members[n_val:])
    train_idx, val_idx = np.sort(np.concatenate(train)), np.sort(np.concatenate(val))
    if len(val_idx) == 0:
        raise UserError(f"too few examples ({len(ids)}) to hold out {val_fraction:.0%} for validation: "
                        "add examples or raise config.classify.val_fraction")
    return train_idx, val_idx


# ----------------------------------------------------------------------------------------------------
# The built-in dataset: which standard-library package does a snippet of source come from?


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
            raise UserError(f"the standard library at {root} has no package {package!r}: the built-in dataset "
                            "needs its sources; use a CSV or JSONL file instead")
        held = _held_out_files({rel: len(t) for rel, t in texts.items()}, val_fraction)
        snippets = {rel: _snippets(texts[rel], length) for rel in sorted(texts)}
        pools[package] = ([s for rel, ss in snippets.items() if rel not in held for s in ss],
                          [s for rel, ss in snippets.items() if rel in held for s in ss])
    n_val = min(round(per_class * val_fraction), *(len(v) for _, v in pools.values()))
    n_train = min(per_class - n_val, *(len(t) for t, _ in pools.values()))
    if n_val < 1 or n_train < 1:
        raise UserError(f"the standard library at {root} is too small for the built-in dataset at val_fraction "
                        f"{val_fraction}: use a CSV or JSONL file")
    splits = [Examples([s for p in packages for s in _spread(pools[p][i], n)],
                       [p for p in packages for _ in range(n)], f"stdlib_packages ({name})")
              for i, (n, name) in enumerate(((n_train, "train"), (n_val, "val")))]
    description = (f"stdlib_packages: {length}-character snippets of Python {sys.version.split()[0]}'s "
                   f"{', '.join(packages)} sources at {root}; {n_train} train + {n_val} val per class, "
                   "validation files disjoint from training files")
    return splits[0], splits[1], description



def load_task(data: str, val_fraction: float, seed: int) -> tuple[Examples, Examples, list[Label], str]:
    """(train, val, label names, description) for config.classify.data: a built-in dataset or a file."""
    if data in BUILTIN_DATASETS:
        train, val, description = stdlib_packages_task(val_fraction)
        return train, val, label_names(train.labels + val.labels), description
    examples = read_labelled(data)
    names = label_names(examples.labels, examples.where)
    train_idx, val_idx = stratified_split(label_ids(examples.labels, names), val_fraction, seed)
    pick = lambda idx, part: Examples([examples.texts[i] for i in idx], [examples.labels[i] for i in idx],
                                      f"{examples.where} ({part})")
    description = f"{examples.where}: {len(examples)} examples, {len(names)} classes"
    return pick(train_idx, "train"), pick(val_idx, "val"), names, description


# ----------------------------------------------------------------------------------------------------
# Tokens


def cls_token_id(tokenizer: Tokenizer, cls_token: str = "") -> int:
    """The classification token: config.classify.cls_token if given, else end-of-text (BPE) or "\\n" (char models)."""
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
                        "--config.classify.cls_token to one character (char models) or token (BPE) the model knows")
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


def majority_baseline(train_ids: np.ndarray, val_ids: np.ndarray) -> tuple[int, float]:
    """(class, held-out accuracy) of always predicting the training set's most frequent class."""
    majority = Counter(train_ids.tolist()).most_common(1)[0][0]
    return majority, float(np.mean(val_ids == majority))


# ----------------------------------------------------------------------------------------------------
# Encoded task


@dataclasses.dataclass(frozen=True)
class EncodedTask:
    """A task ready for the model: token arrays per split, the label names, and the row width W."""

    data: dict[str, dict[str, np.ndarray]]  # split -> {"x" (N, W), "mask" (N, W), "label" (N,), "weight" (N,)}
    names: list[Label]
    width: int
    description: str


def encode_task(task: tuple[Examples, Examples, list[Label], str], tokenizer: Tokenizer, cls_id: int,
                max_len: int | None, block_size: int) -> EncodedTask:
    """Tokenize `load_task`'s examples and pad every row to one width: the longest row, at most max_len."""
    train_ex, val_ex, names, description = task
    max_len = max_len or block_size
    if max_len > block_size:
        raise UserError(f"config.classify.max_len={max_len} exceeds the model's block_size {block_size}: lower it")
    parts = {"train": train_ex, "val": val_ex}
    tokens = {part: tokenize(ex.texts, tokenizer, ex.where) for part, ex in parts.items()}
    width = min(max_len, 1 + max(len(r) for rows in tokens.values() for r in rows))  # no wider than needed
    data = {}
    for part, ex in parts.items():
        x, mask = pad_rows(tokens[part], cls_id, width)
        data[part] = {"x": x, "mask": mask, "label": label_ids(ex.labels, names), "weight": np.ones(len(x), np.float32)}
    return EncodedTask(data, names, width, description)
