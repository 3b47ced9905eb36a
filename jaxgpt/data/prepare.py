"""Preparing a dataset from text of any size: parallel tokenization into token shards, in bounded memory.

The text arrives as a stream of pieces (`jaxgpt.data.sources`); worker processes tokenize batches of pieces
while the main process writes their ids, in stream order, into fixed-size shard files. Memory holds only the
batches in flight, whatever the corpus size; the ids are the same whatever the number of workers (each piece
tokenizes alone to the ids it has in the whole text), so the shards are byte-identical too.

Everything is written in a workspace beside the output directory (`.NAME.preparing`). Each completed shard
is recorded in its progress.jsonl with the point where the stream continues after it, so running the same
command after a kill resumes from the completed shards (the text before them is read again, not tokenized).
meta.json is written last and the dataset moved into place complete (`jaxgpt.data.dataset.install`).
"""

from __future__ import annotations

import collections
import fcntl
import hashlib
import itertools
import json
import multiprocessing
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from jaxgpt.data import dataset
from jaxgpt.data.sources import Piece, text_stream
from jaxgpt.data.tokenizer import CharTokenizer, Tokenizer, tokenizer_from_meta
from jaxgpt.data.tokens import token_dtype
from jaxgpt.errors import UserError

SHARD_TOKENS = 100_000_000  # as llm.c's and modded-nanogpt's published shards
TASK_CHARS = 4 << 20  # text per worker task: large enough that passing it to a process costs little
IN_FLIGHT = 2  # tasks queued per worker: keeps workers busy while bounding memory

_worker_tokenizer: Tokenizer | None = None


def _start_worker(tokenizer_meta: dict[str, Any], bpe_file: str | None) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer_from_meta(tokenizer_meta, bpe_file)


def encode(tokenizer: Tokenizer, pieces: list[Piece], first_index: int) -> tuple[list[np.ndarray], int]:
    """The ids of each piece (a document's first piece after the stream's first is led by the end-of-text
    token, when the tokenizer has one), and the UTF-8 bytes the pieces hold."""
    out, n_bytes = [], 0
    for i, (starts_document, text) in enumerate(pieces):
        ids = tokenizer.encode_array(text)
        if starts_document and tokenizer.eot_token is not None and first_index + i:
            ids = np.concatenate([np.array([tokenizer.eot_token], ids.dtype), ids])
        out.append(ids)
        n_bytes += len(text.encode("utf-8"))
    return out, n_bytes


def _worker_encode(pieces: list[Piece], first_index: int) -> tuple[list[np.ndarray], int]:
    assert _worker_tokenizer is not None
    return encode(_worker_tokenizer, pieces, first_index)


def _tasks(stream: Iterable[Piece], start: int) -> Iterator[tuple[int, list[Piece]]]:
    """Batches of about TASK_CHARS of text from piece `start` on, with the index of their first piece."""
    batch: list[Piece] = []
    first, chars = start, 0
    for index, piece in enumerate(stream):
        if index < start:
            continue
        batch.append(piece)
        chars += len(piece[1])
        if chars >= TASK_CHARS:
            yield first, batch
            batch, first, chars = [], index + 1, 0
    if batch:
        yield first, batch


def _encoded(stream: Iterable[Piece], tokenizer: Tokenizer, workers: int, bpe_file: str | None, start: int
             ) -> Iterator[tuple[int, list[np.ndarray], int]]:
    """(first piece index, ids of each piece, bytes) per task, in stream order. Text of one task (a small
    corpus) is tokenized here: starting processes would cost more than it saves."""
    tasks = _tasks(stream, start)
    head = list(itertools.islice(tasks, 2))
    if workers == 1 or len(head) < 2:
        for first, batch in itertools.chain(head, tasks):
            yield first, *encode(tokenizer, batch, first)
        return
    # spawn: workers must not inherit a parent's threads (JAX, tqdm) through fork
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_start_worker,
                             initargs=(tokenizer.to_meta(), bpe_file)) as pool:
        pending: collections.deque = collections.deque()
        for first, batch in itertools.chain(head, tasks):
            pending.append((first, pool.submit(_worker_encode, batch, first)))
            if len(pending) >= IN_FLIGHT * workers:
                index, future = pending.popleft()
                yield index, *future.result()
        while pending:
            index, future = pending.popleft()
            yield index, *future.result()


class _Shards:
    """Fixed-size shard files filled in stream order; each completed one is appended to progress.jsonl."""

    def __init__(self, workspace: Path, dtype: np.dtype, shard_tokens: int, done: list[dict[str, Any]],
                 unk_token: int | None) -> None:
        self.workspace, self.dtype, self.shard_tokens, self.done = workspace, dtype, shard_tokens, done
        self.unk_token = unk_token
        self.file: Any = None

    def _open(self) -> None:
        self.name = dataset.shard_name(len(self.done))
        self.file = open(self.workspace / self.name, "wb")  # noqa: SIM115 -- open across many add() calls
        self.n, self.unknown, self.hash = 0, 0, hashlib.sha256()

    def add(self, ids: np.ndarray, piece: int, skip: int) -> None:
        """Write the ids of piece `piece` from its `skip`-th on."""
        pos = skip
        while pos < len(ids):
            if self.file is None:
                self._open()
            take = min(len(ids) - pos, self.shard_tokens - self.n)
            chunk = ids[pos:pos + take].astype(self.dtype)
            self.file.write(chunk.tobytes())
            self.hash.update(chunk.tobytes())
            if self.unk_token is not None:
                self.unknown += int(np.count_nonzero(chunk == self.unk_token))
            self.n, pos = self.n + take, pos + take
            if self.n == self.shard_tokens:
                self.close([piece, pos] if pos < len(ids) else [piece + 1, 0])

    def close(self, resume_at: list[int] | None) -> None:
        """Finish the open shard; `resume_at` is (piece, ids to skip) where the stream continues after it."""
        if self.file is None:
            return
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        self.file = None
        record = {"file": self.name, "tokens": self.n, "sha256": self.hash.hexdigest(), "unknown": self.unknown,
                  "resume_at": resume_at}
        with open(self.workspace / "progress.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.done.append(record)


def _completed(workspace: Path, settings: dict[str, Any]) -> list[dict[str, Any]]:
    """The shards a killed preparation of the same settings completed; anything else there is removed."""
    try:
        same = json.loads((workspace / "prepare.json").read_text()) == settings
        lines = (workspace / "progress.jsonl").read_text().splitlines() if same else []
    except (OSError, ValueError):
        same, lines = False, []
    done = []
    for line in lines:
        try:
            record = json.loads(line)
            size = record["tokens"] * np.dtype(settings["dtype"]).itemsize
            intact = (workspace / record["file"]).stat().st_size == size
        except (OSError, ValueError, KeyError, TypeError):
            break
        if not intact:
            break
        done.append(record)
    if not same:
        shutil.rmtree(workspace, ignore_errors=True)
    workspace.mkdir(parents=True, exist_ok=True)
    keep = {r["file"] for r in done} | {"prepare.json"}
    for path in workspace.iterdir():
        if path.name not in keep:
            path.unlink()
    (workspace / "progress.jsonl").write_text("".join(json.dumps(r) + "\n" for r in done))
    (workspace / "prepare.json").write_text(json.dumps(settings))
    return done


def _locked(workspace: Path) -> Any:
    """An exclusive lock on the workspace, so two preparations of one output cannot interleave their shards."""
    lock = open(workspace.parent / f"{workspace.name}.lock", "w")  # noqa: SIM115 -- held until prepare() ends
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise UserError(f"another `jaxgpt data` is preparing into {workspace} right now: wait for it to finish, "
                        "or choose another --out") from None
    return lock


def _vocabulary(stream: Callable[[], Iterable[Piece]]) -> CharTokenizer:
    chars: set[str] = set()
    for _, text in stream():
        chars.update(text)
    if not chars:
        raise UserError("no text to prepare (the texts or files are empty): give at least one non-empty text")
    return CharTokenizer("".join(sorted(chars)))


def prepare(stream: Callable[[], Iterable[Piece]], out_dir: str | os.PathLike[str],
            tokenizer: Tokenizer | Callable[[Iterable[str]], Tokenizer] | None, *, val_fraction: float, source: str,
            overwrite: bool = False, workers: int = 1, shard_tokens: int = SHARD_TOKENS,
            bpe_file: str | None = None) -> dict[str, Any]:
    """Tokenize the pieces `stream()` yields into a dataset in `out_dir` and return its meta.

    `tokenizer=None` builds a character vocabulary of exactly this text and a callable builds the tokenizer
    from the texts (a word vocabulary), both in a first pass over the stream. The last `val_fraction` of the
    ids is the validation split, so validation text is never also training text.
    """
    if not 0.0 < val_fraction < 1.0:
        raise UserError(f"val_fraction {val_fraction} must be between 0 and 1 (exclusive), e.g. 0.1")
    if workers < 1 or shard_tokens < 1:
        raise UserError(f"workers ({workers}) and shard_tokens ({shard_tokens}) must be at least 1")
    out = Path(out_dir).absolute()
    dataset.check_may_write(out, None, overwrite)
    if tokenizer is None:
        tokenizer = _vocabulary(stream)
    elif not isinstance(tokenizer, Tokenizer):
        tokenizer = tokenizer(text for _, text in stream())
    dtype = token_dtype(tokenizer.vocab_size)
    workspace = out.parent / f".{out.name}.preparing"
    settings = {"tokenizer": tokenizer.to_meta(), "source": source, "shard_tokens": shard_tokens, "dtype": dtype.str}
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        lock = _locked(workspace)
    except OSError as e:
        raise UserError(f"cannot create output directory {out} ({e.strerror}): use another --out") from None
    try:
        done = _completed(workspace, settings)
        meta = _write(stream, tokenizer, workspace, done, dtype, shard_tokens, workers, bpe_file)
        if not meta["n_tokens"]:
            raise UserError("no text to prepare (the texts or files are empty): give at least one non-empty text")
        meta |= dataset.split_meta(meta["n_tokens"], val_fraction) | {"source": source}
        return dataset.install(workspace, out, meta, overwrite)
    except OSError as e:
        raise dataset.write_error(out, workspace, e) from None
    finally:
        Path(lock.name).unlink(missing_ok=True)
        lock.close()


def _write(stream: Callable[[], Iterable[Piece]], tokenizer: Tokenizer, workspace: Path, done: list[dict[str, Any]],
           dtype: np.dtype, shard_tokens: int, workers: int, bpe_file: str | None) -> dict[str, Any]:
    """The shards after the completed ones `done`; returns the dataset's meta so far (shards, counts)."""
    shards = _Shards(workspace, dtype, shard_tokens, done, tokenizer.unk_token)
    finished = bool(done) and done[-1]["resume_at"] is None
    if not finished:
        start, skip = done[-1]["resume_at"] if done else (0, 0)
        if done:
            print(f"resuming: {len(done)} completed shard(s), {sum(r['tokens'] for r in done):,} tokens, are kept",
                  file=sys.stderr, flush=True)
        bar = tqdm(unit="B", unit_scale=True, desc="tokenizing", disable=None, dynamic_ncols=True)
        t0, new = time.perf_counter(), 0
        for first, ids, n_bytes in _encoded(stream(), tokenizer, workers, bpe_file, start):
            for i, piece_ids in enumerate(ids):
                dropped = skip if first + i == start else 0
                shards.add(piece_ids, first + i, dropped)
                new += len(piece_ids) - dropped
            bar.update(n_bytes)
            bar.set_postfix_str(f"{new:,} tokens, {new / (time.perf_counter() - t0):,.0f} tokens/s", refresh=False)
        bar.close()
        shards.close(None)
    records = shards.done
    meta: dict[str, Any] = {"format_version": 2, "tokenizer": tokenizer.to_meta(), "vocab_size": tokenizer.vocab_size,
                            "eot_token": tokenizer.eot_token, "dtype": dtype.name,
                            "n_tokens": sum(r["tokens"] for r in records),
                            "shards": [{k: r[k] for k in ("file", "tokens", "sha256")} for r in records]}
    if tokenizer.unk_token is not None:
        meta["unknown_tokens"] = sum(r["unknown"] for r in records)
    return meta


def prepare_text(
    texts_or_paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    tokenizer: Tokenizer | Callable[[Iterable[str]], Tokenizer] | None = None,
    val_fraction: float = 0.1,
    source: str | None = None,
    overwrite: bool = False,
    *,
    workers: int = 1,
    shard_tokens: int = SHARD_TOKENS,
    text_field: str = "text",
    bpe_file: str | None = None,
) -> dict[str, Any]:
    """Tokenize documents into a dataset in `out_dir` and return its meta (`prepare`).

    Items that are `str` are the text itself; `os.PathLike` items (e.g. `Path`) are UTF-8 files, directories
    or glob patterns (`jaxgpt.data.sources.text_stream`). Documents are concatenated in order, with the
    end-of-text token between them for BPE and words.
    """
    items = [texts_or_paths] if isinstance(texts_or_paths, (str, os.PathLike)) else list(texts_or_paths)
    if source is None:
        paths = [os.fspath(item) for item in items if not isinstance(item, str)]
        source = f"files: {', '.join(paths)}" if paths else f"{len(items)} text(s) given in Python"
    return prepare(lambda: text_stream(items, text_field), out_dir, tokenizer, val_fraction=val_fraction,
                   source=source, overwrite=overwrite, workers=workers, shard_tokens=shard_tokens, bpe_file=bpe_file)
