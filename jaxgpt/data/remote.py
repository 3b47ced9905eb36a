"""Datasets in a bucket: prepared locally and published file by file, staged back into a local cache to train.

`jaxgpt data --out gs://...` prepares into a local directory kept per URL (so an interrupted preparation
resumes there), then uploads the token files and `meta.json` last: a reader that finds a meta.json finds
every file it names. Reading one back is `dataset.load_dataset`'s (it stages the files).
"""

from __future__ import annotations

import json
from pathlib import Path

from jaxgpt import storage
from jaxgpt.data.dataset import META_FILE, content_key, token_files
from jaxgpt.errors import UserError


def local_copy(url: str) -> Path:
    """Where `jaxgpt data --out URL` prepares before publishing (it persists, so a rerun resumes)."""
    return storage.cache_dir("prepared", url)


def check_may_publish(url: str, overwrite: bool) -> None:
    """Before tokenizing: refuse a bucket location holding files that are not a dataset (nothing is written)."""
    target = storage.location(url, "--out")
    names = storage.files(target)
    if names and META_FILE not in names and not overwrite:
        raise UserError(f"{url} holds {', '.join(names[:3])} without a meta.json: pass --overwrite to replace "
                        "them, or choose another --out")


def publish(local: Path, url: str, overwrite: bool) -> None:
    """Upload the dataset in `local` to `url`: token files, then meta.json. The same tokens already there are
    left as they are; a different dataset is replaced only with `overwrite` (its meta.json goes first)."""
    target = storage.location(url, "--out")
    meta = json.loads((local / META_FILE).read_bytes())
    names = storage.files(target)
    if META_FILE in names:
        with storage.guard(target, "reading"):
            try:
                old = json.loads((target / META_FILE).read_bytes())
            except ValueError:
                old = None
        if isinstance(old, dict) and content_key(old) == content_key(meta):
            return
        if not overwrite:
            raise UserError(f"{url} already holds a different dataset: pass --overwrite to replace it (the new one "
                            f"is prepared in {local}), or choose another --out")
    storage.publish(local, target, [*token_files(meta), META_FILE], commit=META_FILE)

