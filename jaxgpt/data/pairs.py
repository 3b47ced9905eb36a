"""Source/target text pairs for the encoder-decoder task: files, built-in datasets, model ids, batches.

- Files: TSV (`source<TAB>target`, further columns ignored, so Tatoeba/Anki's `source<TAB>target<TAB>
  attribution` lines work as they are) or JSONL (`{"source": ..., "target": ...}` per line); blank lines
  are skipped, and any other malformed line is a one-line error naming file:line.
- Built-in datasets, no download: `copy` / `reverse` (the Annotated Transformer's synthetic task: random
  symbol strings, the target is the string or its reverse) and `stdlib_identifiers` (the running
  interpreter's snake_case identifiers, the target their words in reverse order; see `stdlib_pairs`).
- Model ids: one text tokenizer for sources and targets, with three specials placed before the text ids
  (`SPECIALS`: pad 0, bos 1, eos 2; text id t is model id t + 3). Sources are model ids right-padded with
  pad, without bos or eos (`encode_text`); the decoder reads [bos] + target and predicts target + [eos].
- Batches: the training batch of step i is a pure function of (seed, i) (`jaxgpt.data.batches.batch_indices`),
  so a resumed run needs no iterator state; evaluation batches are fixed.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxgpt.data.batches import held_out_split
from jaxgpt.data.corpora import stdlib_files, stdlib_root
from jaxgpt.data.streams import BUILTIN_STREAM
from jaxgpt.data.tokenizer import CharTokenizer, Tokenizer, WordTokenizer
from jaxgpt.data.user_files import jsonl_objects, read_text
from jaxgpt.errors import UserError

Pair = tuple[str, str]

SPECIALS: dict[str, int] = {"pad_id": 0, "bos_id": 1, "eos_id": 2, "offset": 3}
SYNTHETIC = ("copy", "reverse")
BUILTIN = (*SYNTHETIC, "stdlib_identifiers")
FILE_SUFFIXES = (".tsv", ".txt", ".jsonl")
TOKENIZERS = ("char", "word")
SYMBOLS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
IDENTIFIER = re.compile(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b")


# ----------------------------------------------------------------------------------------------------
# Model ids


def encode_text(tokenizer: Tokenizer, specials: dict[str, int], text: str) -> list[int]:
    """Model ids of `text`: the tokenizer's ids shifted past the specials, no bos or eos."""
    return [t + specials["offset"] for t in tokenizer.encode(text)]


def decode_ids(tokenizer: Tokenizer, specials: dict[str, int], ids: Sequence[int]) -> str:
    """The text of model ids up to the first eos; pad and bos are skipped wherever they are."""
    text_ids = []
    for i in (int(i) for i in ids):
        if i == specials["eos_id"]:
            break
        if i >= specials["offset"]:
            text_ids.append(i - specials["offset"])
    return tokenizer.decode(text_ids)


class PairText:
    """A seq2seq run's text codec for what takes a tokenizer (the server): sources encode to model ids
    (`encode_text`), target ids decode up to eos (`decode_ids`), and eos is the end-of-text token."""

    def __init__(self, tokenizer: Tokenizer, specials: dict[str, int]) -> None:
        self.tokenizer, self.specials = tokenizer, specials
        self.eot_token, self.vocab_size = specials["eos_id"], tokenizer.vocab_size + specials["offset"]

    def encode(self, text: str) -> list[int]:
        if unknown := self.tokenizer.unknown_words(text):
            raise UserError(f"the source has words outside the model's vocabulary: {', '.join(map(repr, unknown[:5]))}")
        return encode_text(self.tokenizer, self.specials, text)

    def decode(self, ids: Sequence[int]) -> str:
        return decode_ids(self.tokenizer, self.specials, ids)


def build_tokenizer(kind: str, texts: Sequence[str], word_vocab: int) -> Tokenizer:
    """The text tokenizer of a pair set, from all its sources and targets: every character they hold ("char"),
    or their `word_vocab` - 2 most frequent words plus [PAD] and [UNK] ("word", seed 004's tokenizer)."""
    if kind not in TOKENIZERS:
        raise UserError(f"config.seq2seq.tokenizer={kind!r} is unknown: choose one of {TOKENIZERS}")
    return CharTokenizer.from_text("".join(texts)) if kind == "char" else WordTokenizer.from_texts(texts, word_vocab)


# ----------------------------------------------------------------------------------------------------
# Files


def _tsv_pairs(path: Path) -> list[tuple[str, Pair]]:
    """("FILE:LINE", (source, target)) of each non-blank line of source<TAB>target."""
    rows = []
    for number, line in enumerate(read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        fields = line.split("\t")
        if len(fields) < 2:
            raise UserError(f"{where}: expected source<TAB>target, found no tab")
        rows.append((where, (fields[0], fields[1])))
    return rows


def _jsonl_pair(row: Any, where: str) -> Pair:
    if not isinstance(row, dict) or not isinstance(row.get("source"), str) or not isinstance(row.get("target"), str):
        raise UserError(f'{where}: expected an object with string keys "source" and "target"')
    return row["source"], row["target"]


def read_pairs(path: str | Path) -> list[Pair]:
    """(source, target) pairs of a TSV (.tsv, .txt) or JSONL (.jsonl) file; empty sources or targets are errors."""
    path = Path(path)
    if path.suffix.lower() not in FILE_SUFFIXES:
        raise UserError(f"config.seq2seq.data={str(path)!r} is neither a built-in dataset ({', '.join(BUILTIN)}) nor a "
                        f"{'/'.join(FILE_SUFFIXES)} file of source/target pairs")
    if not path.is_file():
        raise UserError(f"pair file {path} not found: check --config.seq2seq.data")
    if path.suffix.lower() == ".jsonl":
        rows = [(where, _jsonl_pair(row, where)) for where, row in jsonl_objects(path)]
    else:
        rows = _tsv_pairs(path)
    pairs = []
    for where, (source, target) in rows:
        if not source.strip() or not target.strip():
            raise UserError(f"{where}: the {'source' if not source.strip() else 'target'} is empty")
        pairs.append((source, target))
    if not pairs:
        raise UserError(f"{path} holds no pairs: one source<TAB>target line (or JSON object) per example")
    return pairs


# ----------------------------------------------------------------------------------------------------
# Built-in datasets


def synthetic_pairs(kind: str, n: int, symbols: int, length: int) -> list[Pair]:
    """`n` random strings over the first `symbols` characters of SYMBOLS, lengths uniform in [1, length], each
    paired with itself (copy) or its reverse: the Annotated Transformer's first exercise, with varying lengths
    so that padding is part of it."""
    if not 2 <= symbols <= len(SYMBOLS) or length < 1:
        raise UserError(f"config.seq2seq.symbols={symbols} must be in [2, {len(SYMBOLS)}] and "
                        f"config.seq2seq.length={length} >= 1")
    rng = np.random.Generator(np.random.PCG64([BUILTIN_STREAM, symbols, length]))
    lengths = rng.integers(1, length + 1, size=n)
    codes = rng.integers(0, symbols, size=(n, length))
    texts = ["".join(SYMBOLS[c] for c in row[:k]) for row, k in zip(codes, lengths, strict=True)]
    return [(t, t if kind == "copy" else t[::-1]) for t in texts]


def reverse_words(identifier: str) -> str:
    """get_default_value -> value_default_get."""
    return "_".join(reversed(identifier.split("_")))


def stdlib_pairs(root: Path | None = None, max_chars: int = 32) -> list[Pair]:
    """Every distinct snake_case identifier (two words or more, at most `max_chars` characters) in the
    interpreter's standard library sources, paired with its words in reverse order.

    Why this task: real text that needs no download, a mapping a small model learns in minutes (find the
    word boundaries, copy the words out in reverse order), and held-out identifiers (`split`) contain word
    combinations never seen in training, so exact match measures the rule, not memory.
    """
    root = root or stdlib_root()
    names: set[str] = set()
    for rel in stdlib_files(root):
        try:
            names.update(IDENTIFIER.findall((root / rel).read_bytes().decode("utf-8")))
        except UnicodeDecodeError:
            continue
    pairs = [(name, reverse_words(name)) for name in sorted(names) if len(name) <= max_chars]
    if not pairs:
        raise UserError(f"the standard library at {root} has no Python sources: use a TSV or JSONL file of pairs")
    return pairs


def split(pairs: list[Pair], val_fraction: float) -> tuple[list[Pair], list[Pair]]:
    """(train, val), held out by source: several translations of one sentence stay on one side."""
    return held_out_split(pairs, lambda pair: pair[0].encode(), val_fraction, "pairs", "config.seq2seq.val_fraction")


def load_pairs(data: str, val_fraction: float, examples: int, symbols: int,
               length: int) -> tuple[list[Pair], list[Pair], str]:
    """(train, val, description) for config.seq2seq.data: a built-in dataset or a file."""
    if not data:
        raise UserError("config.seq2seq.data is empty: pass --config.seq2seq.data=PATH, a file of source<TAB>target "
                        "lines (.tsv/.txt, e.g. Tatoeba/Anki's fra.txt) or of JSON objects (.jsonl)")
    if data in SYNTHETIC:
        pairs = synthetic_pairs(data, examples, symbols, length)
        description = (f"{data}: {examples} random strings of 1-{length} of {symbols} symbols, target = the "
                       f"{'same string' if data == 'copy' else 'string reversed'}")
    elif data == "stdlib_identifiers":
        pairs = stdlib_pairs()
        description = (f"stdlib_identifiers: {len(pairs)} snake_case identifiers of Python "
                       f"{sys.version.split()[0]}'s standard library, target = their words in reverse order")
    else:
        pairs = read_pairs(data)
        description = f"{data}: {len(pairs)} pairs"
    train, val = split(pairs, val_fraction)
    return train, val, f"{description}; {len(train)} train / {len(val)} held-out"


# ----------------------------------------------------------------------------------------------------
# Encoding and batches


def to_ids(pairs: Sequence[Pair], tokenizer: Tokenizer) -> list[tuple[list[int], list[int]]]:
    """(source, target) model ids of every pair (`encode_text`), tokenized once for measuring and encoding."""
    return [(encode_text(tokenizer, SPECIALS, s), encode_text(tokenizer, SPECIALS, t)) for s, t in pairs]


def fitting(ids: Sequence[tuple[list[int], list[int]]], max_src: int, max_tgt: int) -> tuple[list[int], int, int]:
    """(indices of the pairs whose source has at most `max_src` tokens and target at most `max_tgt` - 1 (room
    for bos / eos), the longest such source, the longest such target + 1): rows no wider than the data needs."""
    kept = [i for i, (s, t) in enumerate(ids) if len(s) <= max_src and len(t) + 1 <= max_tgt]
    return kept, max((len(ids[i][0]) for i in kept), default=1), max((len(ids[i][1]) + 1 for i in kept), default=1)


def encode_pairs(ids: Sequence[tuple[list[int], list[int]]], src_len: int, tgt_len: int) -> dict[str, np.ndarray]:
    """Rows for the model: src (N, src_len), tgt_in = [bos] + target and tgt_out = target + [eos] (N, tgt_len),
    all right-padded with pad; weight (N,) = 1 (0 marks filler rows of a short evaluation batch)."""
    n, pad = len(ids), SPECIALS["pad_id"]
    src = np.full((n, src_len), pad, np.int32)
    tgt_in = np.full((n, tgt_len), pad, np.int32)
    tgt_out = np.full((n, tgt_len), pad, np.int32)
    for i, (s, t) in enumerate(ids):
        src[i, :len(s)] = s
        tgt_in[i, :len(t) + 1] = [SPECIALS["bos_id"], *t]
        tgt_out[i, :len(t) + 1] = [*t, SPECIALS["eos_id"]]
    return {"src": src, "tgt_in": tgt_in, "tgt_out": tgt_out, "weight": np.ones(n, np.float32)}
