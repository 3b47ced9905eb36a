"""A split's tokens as one stream over memory-mapped files, and the token file formats jaxgpt reads.

A corpus-scale split is many shard files; training draws windows from their concatenation, so the batch of
step i stays a pure function of (seed, i) over all shards, whatever their number. Nothing is read until a
window is: `TokenStream` keeps memory maps and copies only the rows asked for.

Formats besides jaxgpt's own (headerless little-endian ids described by meta.json): llm.c / modded-nanogpt
shards (a 256 x int32 header: magic 20240520, version 1, token count; then uint16 ids) and nanoGPT's
train.bin / val.bin (uint16 ids; meta.pkl for its character vocabularies).
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxgpt.errors import UserError

LLMC_MAGIC, LLMC_VERSION, LLMC_HEADER_INTS = 20240520, 1, 256


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest id type of a vocabulary: uint16 while every id fits, uint32 above 65,536 tokens."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


class TokenStream:
    """The concatenation of token arrays (usually memory maps of shard files), indexed as one array."""

    def __init__(self, parts: Sequence[np.ndarray]) -> None:
        self.parts = [p for p in parts if len(p)]
        self.offsets = np.cumsum([0, *(len(p) for p in self.parts)])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def dtype(self) -> np.dtype:
        return self.parts[0].dtype

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) as one array (a copy only when the range crosses from one file into the next)."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"tokens [{start}, {stop}) are outside a stream of {len(self)}")
        k = int(np.searchsorted(self.offsets, start, side="right")) - 1
        pieces = []
        while start < stop:
            lo = start - int(self.offsets[k])
            hi = min(stop - int(self.offsets[k]), len(self.parts[k]))
            pieces.append(self.parts[k][lo:hi])
            start, k = start + hi - lo, k + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces) if pieces else self.parts[0][:0]

    def view(self, start: int, stop: int) -> TokenStream:
        """Tokens [start, stop) as a stream of views into the same files (nothing is read)."""
        parts = []
        for part, offset in zip(self.parts, self.offsets[:-1], strict=True):
            lo, hi = max(start - int(offset), 0), min(stop - int(offset), len(part))
            if lo < hi:
                parts.append(part[lo:hi])
        return TokenStream(parts)

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """int32 rows: tokens[s : s + length] for each start s."""
        return np.stack([self.read(int(s), int(s) + length) for s in starts]).astype(np.int32)

    def boundaries(self, eot_token: int) -> np.ndarray:
        """Positions where a document begins: 0 and every end-of-text token (it precedes the next document).
        Reads the whole stream once, shard by shard."""
        found = [np.zeros(1, np.int64)]
        for part, offset in zip(self.parts, self.offsets[:-1], strict=True):
            found.append(np.flatnonzero(np.asarray(part) == eot_token).astype(np.int64) + offset)
        return np.unique(np.concatenate(found))

    def __getitem__(self, index: slice | int) -> Any:
        """A slice as an array, or one token."""
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            return self.read(start, max(start, stop))[::step]
        position = index + len(self) if index < 0 else index
        return self.read(position, position + 1)[0]

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        tokens = self.read(0, len(self))
        return tokens if dtype is None else tokens.astype(dtype)

    def tolist(self) -> list[int]:
        return np.asarray(self).tolist()


def llmc_shard(path: Path) -> np.memmap:
    """The uint16 ids of an llm.c / modded-nanogpt shard, its header checked against the file."""
    fix = "it is not an llm.c token shard (magic 20240520, version 1, uint16 ids): re-create it, or remove it"
    size = path.stat().st_size
    if size < 4 * LLMC_HEADER_INTS:
        raise UserError(f"{path} is {size} bytes, shorter than the llm.c header of {4 * LLMC_HEADER_INTS}: {fix}")
    header = np.fromfile(path, dtype="<i4", count=LLMC_HEADER_INTS)
    if header[0] != LLMC_MAGIC or header[1] != LLMC_VERSION:
        raise UserError(f"{path} has magic {header[0]} / version {header[1]}, not {LLMC_MAGIC} / {LLMC_VERSION}: {fix}")
    expected = 4 * LLMC_HEADER_INTS + 2 * int(header[2])
    if size != expected:
        raise UserError(f"{path} has {size} bytes but its header promises {header[2]} tokens ({expected} bytes): "
                        f"truncated or padded; {fix}")
    return np.memmap(path, dtype="<u2", mode="r", offset=4 * LLMC_HEADER_INTS)


class _PlainData(pickle.Unpickler):
    """Unpickles dicts, lists, strings and numbers only: a meta.pkl can run no code while it is read."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name} is not plain data")


def nanogpt_vocabulary(path: Path) -> str:
    """The characters, in id order, of a nanoGPT character-level meta.pkl (`itos`: id -> character)."""
    try:
        with open(path, "rb") as f:
            meta = _PlainData(f).load()
        itos = meta["itos"]
        chars = "".join(itos[i] for i in range(len(itos)))
        if len(chars) != len(itos) or meta.get("vocab_size", len(itos)) != len(itos):
            raise ValueError("itos is not one character per id")
    except (OSError, pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError) as e:
        raise UserError(f"{path} is not a nanoGPT character vocabulary ({e}): remove it for GPT-2 tokens, or "
                        "re-create it with nanoGPT's prepare.py") from None
    return chars
