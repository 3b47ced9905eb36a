"""The batches of a token stream: a pure function of (seed, step), so resuming needs no iterator state.

The global batch of step i depends only on (seed, i): restoring the step restores the batches, and every
host of a multi-host job computes the same global batch while reading only its own rows (`batch_for_step`).
Evaluation batches are fixed per split (`eval_batches`), so losses compare across a run and its resumes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from jaxgpt.data.streams import EVAL_STREAM, EXAMPLE_STREAM
from jaxgpt.data.tokens import TokenStream
from jaxgpt.errors import UserError

Item = TypeVar("Item")

Tokens = np.ndarray | TokenStream  # a split's ids: an array, or a stream over shard files


def check_shapes(n_tokens: int, batch_size: int, block_size: int, split: str) -> None:
    """A UserError unless `split` (n_tokens long) can fill batches of `batch_size` windows of block_size + 1."""
    if batch_size < 1 or block_size < 1:
        raise UserError(f"batch_size {batch_size} and block_size {block_size} must be positive")
    if block_size >= n_tokens:
        raise UserError(f"block size {block_size} is larger than the {split} split ({n_tokens} tokens): "
                        "use a smaller block_size or more data")


def process_share(batch_size: int, process_index: int, process_count: int) -> slice:
    """This process's contiguous share of the global batch's rows."""
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is outside [0, {process_count})")
    if batch_size % process_count:
        raise UserError(f"batch_size {batch_size} is not divisible by the {process_count} processes: use a "
                        f"multiple of {process_count}")
    local = batch_size // process_count
    return slice(process_index * local, (process_index + 1) * local)


def document_starts(boundaries: np.ndarray, n_tokens: int, block_size: int) -> np.ndarray:
    """The document boundaries of a split (`TokenStream.boundaries`) at which a whole window fits."""
    starts = boundaries[boundaries < n_tokens - block_size]
    if not len(starts):
        raise UserError(f"no document starts early enough for a window of {block_size + 1} tokens: use a smaller "
                        "block_size, more data, or data.align_documents=False")
    return starts


def _global_starts(entropy: list[int], n_starts: int, batch_size: int, allowed: np.ndarray | None = None
                   ) -> np.ndarray:
    """`batch_size` window offsets in [0, n_starts), or drawn from `allowed`, a pure function of `entropy`.

    Uses the raw output of the PCG64 bit generator, whose stream NumPy keeps stable across releases
    (Generator methods like `integers` may change), so a checkpoint resumes on the same batches after a
    NumPy upgrade. The modulo bias is below n_starts / 2**64: nil for any corpus.
    """
    if entropy[0] < 0:
        raise UserError(f"seed {entropy[0]} is negative: use a seed >= 0")
    raw = np.random.PCG64(entropy).random_raw(batch_size)
    if allowed is not None:
        return allowed[(raw % np.uint64(len(allowed))).astype(np.int64)]
    return (raw % np.uint64(n_starts)).astype(np.int64)


def _windows(tokens: Tokens, starts: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) int32 rows: x = tokens[s : s + block_size], y = the same window one token later. Reads
    only these windows, so memory maps of any size cost just the rows requested."""
    if isinstance(tokens, TokenStream):
        window = tokens.windows(starts, block_size + 1)
    else:
        window = tokens[starts[:, None] + np.arange(block_size + 1)].astype(np.int32)
    return np.ascontiguousarray(window[:, :-1]), np.ascontiguousarray(window[:, 1:])


def batch_for_step(
    tokens: Tokens,
    *,
    seed: int,
    step: int,
    batch_size: int,
    block_size: int,
    process_index: int = 0,
    process_count: int = 1,
    split: str = "train",
    starts: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """This process's rows of the global training batch of `step`.

    The global batch (`batch_size` random windows) depends only on (seed, step); process p of P gets rows
    [p * batch_size / P, (p + 1) * batch_size / P), so concatenating all processes' results in order gives
    exactly the single-process batch, and no host reads another host's rows. Returns (x, y), int32, of
    shape (batch_size // process_count, block_size). `split` only names the data in error messages;
    `starts` (`document_starts`) restricts where windows begin, e.g. to document boundaries.
    """
    check_shapes(len(tokens), batch_size, block_size, split)
    rows = process_share(batch_size, process_index, process_count)
    chosen = _global_starts([seed, step], len(tokens) - block_size, batch_size, starts)[rows]
    return _windows(tokens, chosen, block_size)


def eval_batches(
    tokens: Tokens,
    *,
    batch_size: int,
    block_size: int,
    n_batches: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
    split: str = "validation",
    starts: np.ndarray | None = None,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """A fixed list of `n_batches` (x, y) batches: the same every call, so evaluation losses are
    comparable across a run and across resumes. Drawn from a stream separate from training batches;
    rows are split across processes exactly as in `batch_for_step`."""
    check_shapes(len(tokens), batch_size, block_size, split)
    rows = process_share(batch_size, process_index, process_count)
    n_starts = len(tokens) - block_size
    return [_windows(tokens, _global_starts([seed, i, EVAL_STREAM], n_starts, batch_size, starts)[rows], block_size)
            for i in range(n_batches)]

def permutation(entropy: list[int], n: int) -> np.ndarray:
    """A permutation of range(n) from PCG64's raw stream, which NumPy keeps stable across releases."""
    if entropy[0] < 0:
        raise UserError(f"seed {entropy[0]} is negative: use a seed >= 0")
    return np.argsort(np.random.PCG64(entropy).random_raw(n), kind="stable")


def batch_indices(seed: int, step: int, n: int, batch_size: int) -> np.ndarray:
    """Example indices of the training batch of `step`: consecutive slices of one shuffle per epoch, a pure
    function of (seed, step), so every example is seen once per epoch and a resumed run sees the same ones."""
    positions = step * batch_size + np.arange(batch_size)
    epochs, offsets = positions // n, positions % n
    out = np.empty(batch_size, np.int64)
    for epoch in np.unique(epochs):
        sel = epochs == epoch
        out[sel] = permutation([seed, EXAMPLE_STREAM, int(epoch)], n)[offsets[sel]]
    return out


def held_out_split(items: list[Item], key: Callable[[Item], bytes], val_fraction: float, what: str,
                   flag: str) -> tuple[list[Item], list[Item]]:
    """(train, val): an item is held out by a hash of `key(item)`, so the split is the same for every run and
    seed, and items that share a key (a source with several translations, a prompt asked twice) are on one
    side only. `what` names the items and `flag` the fraction's key in the one-line error for too few."""
    bound = int(val_fraction * 2**32)
    held = [int.from_bytes(hashlib.sha256(key(item)).digest()[:4], "little") < bound for item in items]
    train = [item for item, h in zip(items, held, strict=True) if not h]
    val = [item for item, h in zip(items, held, strict=True) if h]
    if not train or not val:
        raise UserError(f"{len(items)} {what} are too few to hold out {val_fraction:.0%} for validation and keep "
                        f"some for training: add {what} or change {flag}")
    return train, val


def rows_sha256(rows: dict[str, np.ndarray], keys: tuple[str, ...]) -> str:
    """The sha256 of a split's `keys` arrays, in that order: what a task's meta records of its examples, so a
    resume on other data is refused."""
    return hashlib.sha256(b"".join(rows[k].tobytes() for k in keys)).hexdigest()


def spread_indices(n: int, k: int) -> np.ndarray:
    """min(n, k) distinct indices evenly spaced over range(n): a sample of a class-ordered set that keeps
    every class (the built-in dataset lists its examples class by class)."""
    return np.unique(np.linspace(0, n - 1, min(n, k)).round().astype(np.int64))


def fixed_batches(idx: np.ndarray, batch_size: int) -> list[tuple[np.ndarray, int]]:
    """`idx` cut into batches of one shape (one compiled program), each with how many of its rows are real: the
    last batch is completed by repeating its rows, filler that its user gives no weight (or cuts off)."""
    return [(np.resize(idx[i:i + batch_size], batch_size), len(idx[i:i + batch_size]))
            for i in range(0, len(idx), batch_size)]


def step_rows(data: dict[str, np.ndarray], seed: int, step: int, batch_size: int, process_index: int,
              process_count: int) -> dict[str, np.ndarray]:
    """This process's share of the training batch of `step`: the rows of `data` (arrays of one length) at
    `batch_indices`, so that the batch is a pure function of (seed, step) whatever the process count."""
    idx = batch_indices(seed, step, len(next(iter(data.values()))), batch_size)
    idx = idx[process_share(batch_size, process_index, process_count)]
    return {k: v[idx] for k, v in data.items()}


def filler_batches(data: dict[str, np.ndarray], idx: np.ndarray, batch_size: int, zeroed: tuple[str, ...],
                   share: slice = slice(None)) -> list[dict[str, np.ndarray]]:
    """Rows `idx` of `data` (arrays of one length) in `fixed_batches`, each cut to this process's `share` of its
    rows, with the `zeroed` arrays (a weight, loss masks) zero on the filler rows so that those count nothing."""
    out = []
    for picked, n_real in fixed_batches(idx, batch_size):
        real_B = np.arange(batch_size) < n_real
        rows = {k: v[picked] for k, v in data.items()}
        for k in zeroed:
            rows[k] = rows[k] * real_B.reshape(-1, *[1] * (rows[k].ndim - 1)).astype(rows[k].dtype)
        out.append({k: v[share] for k, v in rows.items()})
    return out


def bucket(length: int, block_size: int, shortest: int = 16) -> int:
    """The padded length of a row of `length` inputs: the next power of two from `shortest`, at most block_size,
    so rows of any length compile one program per bucket (the evaluations' scorer, the engine's prefill, the
    sampler's cache)."""
    return min(block_size, max(shortest, 1 << (length - 1).bit_length()))
