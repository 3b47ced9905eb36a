"""Datasets as token files, written once and read back by memory map, and the formats jaxgpt reads.

A prepared dataset is a directory with `meta.json` (tokenizer, id type, token counts, the sha256 of each
file, where the text came from) and its token files: `tokens_000000.bin`, ... (format 2: shards of
little-endian ids, uint16 while the vocabulary fits and uint32 above, written by `jaxgpt.data.prepare`) or
`train.bin` / `val.bin` (format 1, written before shards). The training split is the stream's first
`n_train` ids and validation the `n_val` after them. `meta.json` is written last, so a directory without it
is never mistaken for a dataset. Directories of llm.c / modded-nanogpt shards and nanoGPT's
train.bin / val.bin (+ meta.pkl) read as they are (`jaxgpt.data.tokens`).

The batches drawn from them are `jaxgpt.data.batches`: a pure function of (seed, step).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from jaxgpt import storage
from jaxgpt.data.tokenizer import (
    GPT2_EOT,
    GPT2_TOKENIZER_META,
    GPT2_VOCAB_SIZE,
    WORD_PAD_ID,
    CharTokenizer,
    Tokenizer,
    tokenizer_from_meta,
)
from jaxgpt.data.tokens import TokenStream, llmc_shard, nanogpt_vocabulary
from jaxgpt.errors import UserError

FORMAT_VERSIONS = (1, 2)
META_FILE = "meta.json"
SPLIT_FILES = {"train": "train.bin", "val": "val.bin"}  # format 1, and nanoGPT's
# Hashing reads the whole file; below this size that costs well under a second, so it is on by default.
VERIFY_MAX_BYTES = 256 * 2**20
PREPARING_MARKER = ".jaxgpt-preparing"  # in a dataset directory while new token files are swapped in
OWN_SHARD = re.compile(r"tokens_\d{6}\.bin")  # format 2's token files (`shard_name`); no other trainer's

# ----------------------------------------------------------------------------------------------------
# Writing a dataset (the tokens come from `jaxgpt.data.prepare`)


def shard_name(index: int) -> str:
    """The file name of a format-2 dataset's shard `index` (what `OWN_SHARD` recognizes)."""
    return f"tokens_{index:06d}.bin"


def content_key(meta: dict[str, Any]) -> tuple:
    """What makes two datasets the same: the tokens and how to read them (not where they came from)."""
    keys = ("tokenizer", "dtype", "n_train", "n_val", "train_sha256", "val_sha256", "shards")
    return tuple(meta.get(k) for k in keys)


def token_files(meta: dict[str, Any]) -> list[str]:
    """The token files a dataset's meta describes."""
    return [s["file"] for s in meta.get("shards", [])] or list(SPLIT_FILES.values())


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


def check_may_write(out_dir: Path, new_meta: dict[str, Any] | None, overwrite: bool) -> dict[str, Any] | None:
    """Refuse to replace anything in `out_dir` unless asked to: it may be the only copy of hours of work.

    Token files without a meta.json are someone's own (refused) unless the marker says an interrupted
    preparation left them. Returns the existing meta when it describes exactly `new_meta`'s tokens (then
    nothing needs writing). With `new_meta=None` only what can be known before tokenizing is checked.
    """
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"cannot create output directory {out_dir} (it is a file): use another --out")
    if overwrite or not out_dir.is_dir():
        return None
    old = _existing_meta(out_dir)
    if old is None:
        own = sorted(p.name for p in out_dir.glob("*.bin"))
        if own and not (out_dir / PREPARING_MARKER).exists():
            raise UserError(f"{out_dir} holds {', '.join(own[:3])} without a meta.json (token files prepared by "
                            "other means?): pass --overwrite (overwrite=True) to replace them, or choose another "
                            "directory")
        return None
    if new_meta is None:
        return None
    if not isinstance(old, dict) or content_key(old) != content_key(new_meta):
        source = old.get("source", "unknown source") if isinstance(old, dict) else "unknown source"
        raise UserError(f"{out_dir} already holds a different dataset ({source}): pass --overwrite "
                        "(overwrite=True) to replace it, or choose another output directory")
    return old


def split_meta(n_tokens: int, val_fraction: float) -> dict[str, int]:
    """n_train and n_val: the last `val_fraction` of the ids is validation."""
    n_val = int(n_tokens * val_fraction)
    if n_val < 1 or n_tokens - n_val < 1:
        raise UserError(f"corpus has only {n_tokens} tokens, too few to split into train and validation at "
                        f"val_fraction {val_fraction}: use more text")
    return {"n_train": n_tokens - n_val, "n_val": n_val}


def install(workspace: Path, out_dir: Path, meta: dict[str, Any], overwrite: bool) -> dict[str, Any]:
    """Put the finished dataset of `workspace` in place and return its meta (an identical dataset already
    there is left untouched). A new or empty directory takes one rename; in a directory that holds other
    files the old meta.json goes first and the new one comes last, with a marker meanwhile, so a kill leaves
    either the old dataset, the new one, or a directory that does not look prepared."""
    meta = {k: v for k, v in meta.items() if k != "n_tokens"}
    same = check_may_write(out_dir, meta, overwrite)
    if same is not None:
        shutil.rmtree(workspace, ignore_errors=True)
        return same
    for name in ("prepare.json", "progress.jsonl"):
        (workspace / name).unlink(missing_ok=True)
    with open(workspace / META_FILE, "w") as f:
        f.write(json.dumps(meta, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    if not out_dir.exists() or (out_dir.is_dir() and not any(out_dir.iterdir())):
        os.replace(workspace, out_dir)
        return meta
    try:
        old = _existing_meta(out_dir)
    except UserError:  # only reachable with overwrite: the unreadable meta is replaced
        old = None
    marker = out_dir / PREPARING_MARKER
    marker.touch()
    (out_dir / META_FILE).unlink(missing_ok=True)
    for name in set(token_files(old or {})) - set(token_files(meta)):
        (out_dir / name).unlink(missing_ok=True)
    for name in token_files(meta):
        os.replace(workspace / name, out_dir / name)
    os.replace(workspace / META_FILE, out_dir / META_FILE)
    marker.unlink()
    shutil.rmtree(workspace, ignore_errors=True)
    return meta


def write_error(out_dir: Path, workspace: Path, e: OSError) -> UserError:
    """A failed write as one line; the completed shards stay in the workspace for the next run to resume."""
    if e.errno in storage.DISK_FULL:
        written = sum(p.stat().st_size for p in workspace.iterdir()) if workspace.is_dir() else 0
        free = storage.free_bytes(out_dir)
        return UserError(f"preparing the dataset in {out_dir} failed ({e.strerror}): it needs more than "
                         f"{written / 2**20:,.1f} MiB ({free / 2**20:,.1f} MiB free there, or a file-size limit "
                         f"applies); {out_dir} was not changed. Free space and run the same command (it resumes from "
                         "the completed shards), or prepare it on another disk")
    return UserError(f"cannot write the dataset into {out_dir} ({e.strerror}: {e.filename}): use another --out")


def unknown_summary(meta: dict[str, Any]) -> str | None:
    """How much of a dataset is its unknown token (words outside a word vocabulary), as one line; None for
    tokenizers that represent every text exactly. Printed by whatever prepares a dataset."""
    n_unknown = meta.get("unknown_tokens")
    if n_unknown is None:
        return None
    total = meta["n_train"] + meta["n_val"]
    return (f"{n_unknown:,} of {total:,} tokens ({100 * n_unknown / total:.2f}%) are the unknown token: words "
            f"outside the {meta['vocab_size']:,}-token vocabulary (a larger vocabulary keeps more of them)")


# ----------------------------------------------------------------------------------------------------
# Loading a dataset


@dataclass(frozen=True, eq=False)
class Dataset:
    """A prepared dataset: its token splits (streams over memory-mapped files) plus its meta.

    The tokenizer is built on first use: training never needs it, and for BPE datasets building it
    requires the ranks file, which a training-only host may not have.
    """

    train: TokenStream
    val: TokenStream
    meta: dict[str, Any]
    bpe_file: str | os.PathLike[str] | None = None

    @cached_property
    def tokenizer(self) -> Tokenizer:
        return tokenizer_from_meta(self.meta["tokenizer"], self.bpe_file)

    @property
    def eot_token(self) -> int | None:
        """The id between documents (read from the meta, so no BPE ranks are needed): None for characters."""
        kind = self.meta["tokenizer"].get("type")
        return self.meta.get("eot_token", GPT2_EOT if kind == "bpe" else WORD_PAD_ID if kind == "word" else None)


META_FIELDS = {"format_version": int, "tokenizer": dict, "vocab_size": int, "dtype": str, "n_train": int,
               "n_val": int}


def read_meta(data_dir: Path) -> dict[str, Any]:
    """Parse and sanity-check meta.json; every problem names the file and says how to fix it."""
    path = data_dir / META_FILE
    fix = f"re-run preparation into {data_dir} with --overwrite"
    try:
        meta = json.loads(path.read_bytes())
    except ValueError as e:
        raise UserError(f"{path} is not valid JSON ({e}): {fix}") from e
    if not isinstance(meta, dict):
        raise UserError(f"{path} does not hold a JSON object: {fix}")
    for field, kind in META_FIELDS.items():
        if not isinstance(meta.get(field), kind):
            raise UserError(f"{path} lacks a valid {field!r} field: {fix}")
    version, dtype = meta["format_version"], meta["dtype"]
    if version not in FORMAT_VERSIONS or dtype not in ("uint16", "uint32") or (version == 1 and dtype != "uint16"):
        raise UserError(f"{path} has format {version} / dtype {dtype}, this jaxgpt reads formats "
                        f"{FORMAT_VERSIONS} with uint16 or uint32 ids: {fix}")
    shards = meta.get("shards") if version == 2 else [{"file": SPLIT_FILES[s], "tokens": meta[f"n_{s}"],
                                                       "sha256": meta.get(f"{s}_sha256")} for s in SPLIT_FILES]
    if not isinstance(shards, list) or not all(isinstance(x, dict) and isinstance(x.get("file"), str)
                                               and isinstance(x.get("tokens"), int) for x in shards):
        raise UserError(f"{path} lacks a valid list of token files: {fix}")
    if meta["n_train"] < 1 or meta["n_val"] < 1 or sum(x["tokens"] for x in shards) != meta["n_train"] + meta["n_val"]:
        raise UserError(f"{path} describes an empty split, or splits its files do not hold: {fix}")
    tok = meta["tokenizer"]
    sizes = {meta["vocab_size"], tok.get("vocab_size", meta["vocab_size"])}
    if tok.get("type") == "char":
        sizes.add(len(tok.get("chars", "")))
    if len(sizes) != 1:
        raise UserError(f"{path} disagrees with itself on the vocabulary size ({sorted(sizes)}): {fix}")
    return {**meta, "files": shards}


def _open_file(data_dir: Path, entry: dict[str, Any], meta: dict[str, Any], check_hash: bool) -> np.memmap:
    """Memory-map one token file after checking its size (always) and sha256 (`check_hash`)."""
    path = data_dir / entry["file"]
    fix = f"re-run preparation into {data_dir} with --overwrite"
    dtype = np.dtype(meta["dtype"]).newbyteorder("<")
    expected_bytes = entry["tokens"] * dtype.itemsize
    if not path.is_file():
        raise UserError(f"{path} is missing: {fix}")
    size = path.stat().st_size
    if size != expected_bytes:
        raise UserError(f"{path} has {size} bytes but meta.json expects {expected_bytes} "
                        f"({entry['tokens']} {meta['dtype']} tokens): truncated or from another dataset; {fix}")
    if check_hash and storage.sha256_file(path) != entry["sha256"]:
        raise UserError(f"{path} does not match the sha256 in meta.json (corrupted or modified): {fix}")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    if check_hash and int(tokens.max()) >= meta["vocab_size"]:  # read once anyway: the pages are cached
        raise UserError(f"{path} holds token id {int(tokens.max())}, beyond the vocabulary of {meta['vocab_size']} "
                        f"in meta.json: {fix}")
    return tokens


def _foreign(root: Path) -> tuple[dict[str, TokenStream], dict[str, Any]]:
    """The splits and a meta of a directory another trainer prepared: llm.c shards or nanoGPT's files.

    jaxgpt's own shards are refused here: without their meta.json nothing says their tokenizer, id type or
    split, and read as llm.c's they would be one headerless file with no validation shard.
    """
    shards = sorted(p for p in root.glob("*.bin") if p.name not in SPLIT_FILES.values())
    own = [p.name for p in shards if OWN_SHARD.fullmatch(p.name)]
    if own:
        raise UserError(f"{root / META_FILE} is missing: {root} holds jaxgpt's token shards ({', '.join(own[:2])}"
                        f"{', ...' if len(own) > 2 else ''}) without the meta.json that describes them (deleted?); "
                        f"rebuild it with `jaxgpt data --text FILE... --out {root} --overwrite` (or --dataset NAME "
                        "for a built-in corpus)")
    if shards:
        val = [p for p in shards if "val" in p.name]
        train = [p for p in shards if "val" not in p.name]
        if not val or not train:
            raise UserError(f"{root} holds llm.c-style shards but no {'validation' if not val else 'training'} "
                            "shard (llm.c names them *_val_*.bin and *_train_*.bin): add one")
        splits = {"train": TokenStream([llmc_shard(p) for p in train]),
                  "val": TokenStream([llmc_shard(p) for p in val])}
        tokenizer, files, chars = GPT2_TOKENIZER_META, [*train, *val], None
        source = f"llm.c token shards in {root}"
    else:
        splits = {s: TokenStream([np.memmap(root / name, dtype="<u2", mode="r")]) for s, name in SPLIT_FILES.items()}
        pkl = root / "meta.pkl"
        chars = nanogpt_vocabulary(pkl) if pkl.exists() else None
        tokenizer = CharTokenizer(chars).to_meta() if chars is not None else GPT2_TOKENIZER_META
        files, source = [root / name for name in SPLIT_FILES.values()], f"nanoGPT token files in {root}"
    vocab_size = len(chars) if not shards and chars is not None else GPT2_VOCAB_SIZE
    meta = {"format_version": 0, "tokenizer": tokenizer, "vocab_size": vocab_size, "dtype": "uint16",
            "n_train": len(splits["train"]), "n_val": len(splits["val"]),
            "shards": [{"file": p.name, "bytes": p.stat().st_size} for p in files], "source": source}
    return splits, meta


def _stage(url: str) -> Path:
    """A local, verified copy of the dataset at `url`: meta.json read fresh, each token file downloaded once
    into JAXGPT_CACHE and kept while its sha256 matches meta.json's. The batch of step i is a function of the
    tokens alone, so training on the copy is training on the bucket's dataset. Each host stages its own
    (benchmarks/bench_checkpoint.py measures the rate)."""
    source = storage.location(url, "data.dir")
    local = storage.cache_dir("staged", str(source))
    with storage.guard(source, "reading"):
        if not (source / META_FILE).exists():
            raise UserError(f"{url}/{META_FILE} not found: {url} is not a prepared dataset; run `jaxgpt data ... "
                            f"--out {url}`")
        (local / META_FILE).write_bytes((source / META_FILE).read_bytes())
    entries = read_meta(local)["files"]
    storage.stage(source, [e["file"] for e in entries], {e["file"]: e["sha256"] for e in entries if e.get("sha256")})
    return local


def load_dataset(data_dir: str | os.PathLike[str], *, verify: bool | None = None,
                 bpe_file: str | os.PathLike[str] | None = None) -> Dataset:
    """Open a dataset, validating it first so that a broken one fails here with a clear message instead of as
    odd losses later. `verify` forces (True) or skips (False) the sha256 check, which by default runs for
    datasets under 256 MB. `bpe_file` is used if the tokenizer is needed (BPE datasets)."""
    root = _stage(str(data_dir)) if storage.is_bucket(data_dir) else Path(data_dir)
    if (root / META_FILE).is_file():
        meta = read_meta(root)
        files = meta.pop("files")
        size = (meta["n_train"] + meta["n_val"]) * np.dtype(meta["dtype"]).itemsize
        check_hash = verify or (verify is None and size < VERIFY_MAX_BYTES)
        stream = TokenStream([_open_file(root, entry, meta, check_hash) for entry in files])
        splits = {"train": stream.view(0, meta["n_train"]), "val": stream.view(meta["n_train"], len(stream))}
    elif root.is_dir() and not (root / PREPARING_MARKER).exists() and (
            any(p.name not in SPLIT_FILES.values() for p in root.glob("*.bin"))
            or all((root / name).is_file() for name in SPLIT_FILES.values())):
        splits, meta = _foreign(root)
    else:
        raise UserError(f"{root / META_FILE} not found: {root} is not a prepared dataset (or its preparation was "
                        f"interrupted); run `jaxgpt data --dataset NAME --out {root}`")
    return Dataset(train=splits["train"], val=splits["val"], meta=meta, bpe_file=bpe_file)
