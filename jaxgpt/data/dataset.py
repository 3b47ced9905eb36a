"""Datasets as flat token files, written once and read back by memory map.

A prepared dataset is a directory with `train.bin` and `val.bin` (the token stream as little-endian
uint16, read back with np.memmap so any size works) and `meta.json` (tokenizer, token counts, sha256 of
each file, where the text came from). `meta.json` is written last, so a directory without it is never
mistaken for a dataset.

The batches drawn from them are `jaxgpt.data.batches`: a pure function of (seed, step).

The built-in corpora are prepared by `jaxgpt.data.corpora`; the command line is `jaxgpt data`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from jaxgpt.data.tokenizer import CharTokenizer, Tokenizer, tokenizer_from_meta
from jaxgpt.errors import UserError

FORMAT_VERSION = 1
TOKEN_DTYPE = np.dtype("<u2")
META_FILE = "meta.json"
SPLIT_FILES = {"train": "train.bin", "val": "val.bin"}
# Hashing reads the whole file; below this size that costs well under a second, so it is on by default.
VERIFY_MAX_BYTES = 256 * 2**20
CHUNK_BYTES = 16 * 2**20


# ----------------------------------------------------------------------------------------------------
# Writing a dataset


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def _content_key(meta: dict[str, Any]) -> tuple:
    """What makes two datasets the same: the tokens and how to read them (not where they came from)."""
    keys = ("tokenizer", "dtype", "n_train", "n_val", "train_sha256", "val_sha256")
    return tuple(meta.get(k) for k in keys)


PREPARING_MARKER = ".jaxgpt-preparing"  # in a dataset directory while new token files are swapped in


def _existing_meta(out_dir: Path) -> dict[str, Any] | None:
    """The meta.json already in `out_dir` (None if there is none); unreadable is a UserError."""
    meta_path = out_dir / META_FILE
    if not meta_path.exists():
        return None
    try:
        return json.loads(meta_path.read_bytes())
    except (OSError, ValueError) as e:
        raise UserError(f"{meta_path} exists but is unreadable ({e}): pass --overwrite (overwrite=True) to replace "
                        "the dataset, or choose another output directory") from e


def _check_may_write(out_dir: Path, new_meta: dict[str, Any] | None, overwrite: bool) -> dict[str, Any] | None:
    """Refuse to replace anything in `out_dir` unless asked to: it may be the only copy of hours of work.

    Token files without a meta.json are someone's own (refused) unless the marker says an interrupted
    preparation left them. Returns the existing meta when it describes exactly `new_meta`'s tokens (then
    nothing needs writing). With `new_meta=None` only what can be known before tokenizing is checked.
    """
    if overwrite or not out_dir.is_dir():
        return None
    old = _existing_meta(out_dir)
    if old is None:
        own = [name for name in SPLIT_FILES.values() if (out_dir / name).exists()]
        if own and not (out_dir / PREPARING_MARKER).exists():
            raise UserError(f"{out_dir} holds {' and '.join(own)} without a meta.json (token files prepared by other "
                            "means?): pass --overwrite (overwrite=True) to replace them, or choose another directory")
        return None
    if new_meta is None:
        return None
    if not isinstance(old, dict) or _content_key(old) != _content_key(new_meta):
        source = old.get("source", "unknown source") if isinstance(old, dict) else "unknown source"
        raise UserError(f"{out_dir} already holds a different dataset ({source}): pass --overwrite "
                        "(overwrite=True) to replace it, or choose another output directory")
    return old


def _disk_full(out_dir: Path, written: int, e: OSError) -> UserError:
    free = shutil.disk_usage(out_dir.parent).free
    return UserError(f"preparing the dataset in {out_dir} failed ({e.strerror}): it needs more than "
                     f"{written / 2**20:,.1f} MiB ({free / 2**20:,.1f} MiB free there, or a file-size limit "
                     "applies); nothing was changed. Free space, or prepare it on another disk")


def _split_tail(all_path: Path, val_path: Path, n_train: int) -> None:
    """Move the tokens after `n_train` into `val_path`, leaving the train tokens in `all_path`."""
    with open(all_path, "r+b") as src, open(val_path, "wb") as dst:
        src.seek(n_train * TOKEN_DTYPE.itemsize)
        while block := src.read(CHUNK_BYTES):
            dst.write(block)
        src.truncate(n_train * TOKEN_DTYPE.itemsize)


def _write_splits(tmp: Path, chunks: Iterable[np.ndarray], tokenizer: Tokenizer, val_fraction: float,
                  source: str) -> dict[str, Any]:
    """The whole dataset (token files, then meta.json) in the temporary directory `tmp`; returns its meta."""
    train_path, val_path = tmp / SPLIT_FILES["train"], tmp / SPLIT_FILES["val"]
    n_unknown = 0  # tokens that stand for text outside the vocabulary (word tokenizers): reported, not hidden
    with open(train_path, "wb") as f:
        for chunk in chunks:
            f.write(np.asarray(chunk).astype(TOKEN_DTYPE).tobytes())
            n_unknown += 0 if tokenizer.unk_token is None else int(np.count_nonzero(chunk == tokenizer.unk_token))
    n_total = train_path.stat().st_size // TOKEN_DTYPE.itemsize
    n_val = int(n_total * val_fraction)
    n_train = n_total - n_val
    if n_val < 1 or n_train < 1:
        raise UserError(f"corpus has only {n_total} tokens, too few to split into train and validation at "
                        f"val_fraction {val_fraction}: use more text")
    _split_tail(train_path, val_path, n_train)
    meta = {
        "format_version": FORMAT_VERSION,
        "tokenizer": tokenizer.to_meta(),
        "vocab_size": tokenizer.vocab_size,
        "dtype": "uint16",
        "n_train": n_train,
        "n_val": n_val,
        "train_sha256": _sha256_file(train_path),
        "val_sha256": _sha256_file(val_path),
        "source": source,
    }
    if tokenizer.unk_token is not None:
        meta["unknown_tokens"] = n_unknown
    for path in (train_path, val_path):  # on disk before meta.json says they are there
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
    with open(tmp / META_FILE, "w") as f:
        f.write(json.dumps(meta, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return meta


def _install(tmp: Path, out_dir: Path) -> None:
    """Put the finished dataset of `tmp` in place: one rename for a new (or empty) directory; in a directory
    that holds other files, the old meta.json goes first and the new one comes last, with a marker meanwhile,
    so a kill leaves either the old dataset, the new one, or a directory that does not look prepared."""
    if not out_dir.exists() or (out_dir.is_dir() and not any(out_dir.iterdir())):
        os.replace(tmp, out_dir)
        return
    marker = out_dir / PREPARING_MARKER
    marker.touch()
    (out_dir / META_FILE).unlink(missing_ok=True)
    for name in SPLIT_FILES.values():
        os.replace(tmp / name, out_dir / name)
    os.replace(tmp / META_FILE, out_dir / META_FILE)
    marker.unlink()


def write_dataset(
    out_dir: Path,
    chunks: Iterable[np.ndarray],
    tokenizer: Tokenizer,
    *,
    val_fraction: float,
    source: str,
    overwrite: bool,
) -> dict[str, Any]:
    """Stream token chunks to disk, split off the last `val_fraction` as validation, write meta.json.

    Everything is written into a temporary directory beside `out_dir` and moved into place only when
    complete (`_install`), so a failure, a full disk or a kill never leaves anything that looks prepared.
    An existing dataset is replaced only with `overwrite`; the same tokens again leave it untouched.
    """
    if not 0.0 < val_fraction < 1.0:
        raise UserError(f"val_fraction {val_fraction} must be between 0 and 1 (exclusive), e.g. 0.1")
    if tokenizer.vocab_size > np.iinfo(TOKEN_DTYPE).max + 1:
        raise UserError(
            f"vocabulary of {tokenizer.vocab_size} tokens does not fit uint16 token files: use a tokenizer "
            "with at most 65536 tokens"
        )
    out_dir = out_dir.absolute()
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"cannot create output directory {out_dir} (it is a file): use another --out")
    _check_may_write(out_dir, None, overwrite)
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = out_dir.parent / f".{out_dir.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        tmp.mkdir(mode=0o755)  # the umask's permissions, unlike tempfile's owner-only: datasets are shared
    except OSError as e:
        raise UserError(f"cannot create output directory {out_dir} ({e.strerror}): use another --out") from e
    try:
        meta = _write_splits(tmp, chunks, tokenizer, val_fraction, source)
        same = _check_may_write(out_dir, meta, overwrite)
        if same is not None:
            return same
        _install(tmp, out_dir)
        return meta
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            raise _disk_full(out_dir, sum(p.stat().st_size for p in tmp.iterdir()), e) from None
        raise UserError(f"cannot write the dataset into {out_dir} ({e.strerror}: {e.filename}): "
                        "use another --out") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def unknown_summary(meta: dict[str, Any]) -> str | None:
    """How much of a dataset is its unknown token (words outside a word vocabulary), as one line; None for
    tokenizers that represent every text exactly. Printed by whatever prepares a dataset."""
    n_unknown = meta.get("unknown_tokens")
    if n_unknown is None:
        return None
    total = meta["n_train"] + meta["n_val"]
    return (f"{n_unknown:,} of {total:,} tokens ({100 * n_unknown / total:.2f}%) are the unknown token: words "
            f"outside the {meta['vocab_size']:,}-token vocabulary (a larger vocabulary keeps more of them)")


def _read_text_file(path: Path) -> str:
    """Bytes decoded as strict UTF-8 (no newline translation), so the dataset reflects the file exactly."""
    try:
        return path.read_bytes().decode("utf-8")
    except OSError as e:
        raise UserError(f"cannot read text file {path} ({e.strerror}): check the path") from e
    except UnicodeDecodeError as e:
        raise UserError(
            f"{path} is not UTF-8 text (bad byte at offset {e.start}): convert it to UTF-8"
        ) from e


def document_chunks(documents: Iterable[str], tokenizer: Tokenizer) -> Iterator[np.ndarray]:
    """Token chunks of the documents in order; the end-of-text token (if any) separates documents."""
    separator = None if tokenizer.eot_token is None else np.array([tokenizer.eot_token])
    for i, document in enumerate(documents):
        if i and separator is not None:
            yield separator
        yield tokenizer.encode_array(document)


def prepare_text(
    texts_or_paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    tokenizer: Tokenizer | Callable[[list[str]], Tokenizer] | None = None,
    val_fraction: float = 0.1,
    source: str | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Tokenize documents into a dataset in `out_dir` and return its meta.

    Items that are `str` are the text itself; `os.PathLike` items (e.g. `Path`) are UTF-8 files to read.
    `tokenizer=None` builds a character vocabulary of exactly this corpus; a callable builds the tokenizer from
    the documents (e.g. a word vocabulary, `WordTokenizer.from_texts`). Documents are concatenated in
    order (with the end-of-text token between them for BPE and words), and the last `val_fraction` of the token
    stream becomes the validation split, so validation text is never also training text.
    """
    items = [texts_or_paths] if isinstance(texts_or_paths, (str, os.PathLike)) else list(texts_or_paths)
    documents = [item if isinstance(item, str) else _read_text_file(Path(item)) for item in items]
    if not any(documents):
        raise UserError("no text to prepare (the texts or files are empty): give at least one non-empty text")
    if tokenizer is None:
        tokenizer = CharTokenizer("".join(sorted(set().union(*map(set, documents)))))
    elif not isinstance(tokenizer, Tokenizer):
        tokenizer = tokenizer(documents)
    if source is None:
        paths = [os.fspath(item) for item in items if not isinstance(item, str)]
        source = f"files: {', '.join(paths)}" if paths else f"{len(items)} text(s) given in Python"
    return write_dataset(
        Path(out_dir), document_chunks(documents, tokenizer), tokenizer,
        val_fraction=val_fraction, source=source, overwrite=overwrite,
    )


# ----------------------------------------------------------------------------------------------------
# Loading a dataset


@dataclass(frozen=True, eq=False)
class Dataset:
    """A prepared dataset: memory-mapped token splits plus their meta.

    The tokenizer is built on first use: training never needs it, and for BPE datasets building it
    requires the ranks file, which a training-only host may not have.
    """

    train: np.memmap
    val: np.memmap
    meta: dict[str, Any]
    bpe_file: str | os.PathLike[str] | None = None

    @cached_property
    def tokenizer(self) -> Tokenizer:
        return tokenizer_from_meta(self.meta["tokenizer"], self.bpe_file)


META_FIELDS = {"format_version": int, "tokenizer": dict, "vocab_size": int, "dtype": str, "n_train": int,
               "n_val": int, "train_sha256": str, "val_sha256": str}


def _read_meta(data_dir: Path) -> dict[str, Any]:
    """Parse and sanity-check meta.json; every problem names the file and says how to fix it."""
    path = data_dir / META_FILE
    fix = f"re-run preparation into {data_dir} with --overwrite"
    if not path.is_file():
        raise UserError(f"{path} not found: {data_dir} is not a prepared dataset (or its preparation was "
                        f"interrupted); run `jaxgpt data --dataset NAME --out {data_dir}`")
    try:
        meta = json.loads(path.read_bytes())
    except ValueError as e:
        raise UserError(f"{path} is not valid JSON ({e}): {fix}") from e
    if not isinstance(meta, dict):
        raise UserError(f"{path} does not hold a JSON object: {fix}")
    for field, kind in META_FIELDS.items():
        if not isinstance(meta.get(field), kind):
            raise UserError(f"{path} lacks a valid {field!r} field: {fix}")
    if meta["format_version"] != FORMAT_VERSION or meta["dtype"] != "uint16":
        raise UserError(f"{path} has format {meta['format_version']} / dtype {meta['dtype']}, this jaxgpt "
                        f"reads format {FORMAT_VERSION} / uint16: {fix}")
    if meta["n_train"] < 1 or meta["n_val"] < 1:
        raise UserError(f"{path} describes an empty split: {fix}")
    tok = meta["tokenizer"]
    sizes = {meta["vocab_size"], tok.get("vocab_size", meta["vocab_size"])}
    if tok.get("type") == "char":
        sizes.add(len(tok.get("chars", "")))
    if len(sizes) != 1:
        raise UserError(f"{path} disagrees with itself on the vocabulary size ({sorted(sizes)}): {fix}")
    return meta


def _open_split(data_dir: Path, split: str, meta: dict[str, Any], verify: bool | None) -> np.memmap:
    """Memory-map one split after checking its size (always) and sha256 (`verify`; None = if small)."""
    path = data_dir / SPLIT_FILES[split]
    fix = f"re-run preparation into {data_dir} with --overwrite"
    expected_bytes = meta[f"n_{split}"] * TOKEN_DTYPE.itemsize
    if not path.is_file():
        raise UserError(f"{path} is missing: {fix}")
    size = path.stat().st_size
    if size != expected_bytes:
        raise UserError(f"{path} has {size} bytes but meta.json expects {expected_bytes} "
                        f"({meta[f'n_{split}']} uint16 tokens): truncated or from another dataset; {fix}")
    check_hash = verify or (verify is None and size < VERIFY_MAX_BYTES)
    if check_hash and _sha256_file(path) != meta[f"{split}_sha256"]:
        raise UserError(f"{path} does not match the sha256 in meta.json (corrupted or modified): {fix}")
    tokens = np.memmap(path, dtype=TOKEN_DTYPE, mode="r")
    if check_hash and int(tokens.max()) >= meta["vocab_size"]:  # read once anyway: the pages are cached
        raise UserError(f"{path} holds token id {int(tokens.max())}, beyond the vocabulary of {meta['vocab_size']} "
                        f"in meta.json: {fix}")
    return tokens


def load_dataset(data_dir: str | os.PathLike[str], *, verify: bool | None = None,
                 bpe_file: str | os.PathLike[str] | None = None) -> Dataset:
    """Open a prepared dataset, validating it first so that a broken one fails here with a clear message
    instead of as odd losses later. `verify` forces (True) or skips (False) the sha256 check, which by
    default runs for files under 256 MB. `bpe_file` is used if the tokenizer is needed (BPE datasets)."""
    root = Path(data_dir)
    meta = _read_meta(root)
    train, val = (_open_split(root, split, meta, verify) for split in SPLIT_FILES)
    return Dataset(train=train, val=val, meta=meta, bpe_file=bpe_file)
