"""Rows of a Hugging Face Hub dataset named in a config (`hf:NAME[:SUBSET[:SPLIT]]`), read with `datasets`.

Chat SFT and RL read conversations (a `messages` column) and task dpo reads preference pairs (`prompt`, `chosen`,
`rejected`) this way; each checks its rows itself. `datasets` downloads a dataset once and caches it; NAME may also be
a local directory of data files (JSON lines, parquet, CSV) that `datasets.load_dataset` reads. Without the library,
or without a network for a dataset not in the cache, the error is one line naming the offline route: save the
dataset as JSON lines where the Hub is reachable, then give that file to the config key instead.
"""

from __future__ import annotations

from typing import Any

from jaxgpt.errors import UserError, one_line

HUB_SPEC = "hf:NAME[:SUBSET[:SPLIT]]"  # a config's data naming a Hub dataset; SPLIT defaults to train


def hub_route(name: str, subset: str | None, split: str, columns: tuple[str, ...], key: str, file: str) -> str:
    """How to do without the Hub: save the dataset's `columns` as `file` where it is reachable, pass `key`=file."""
    args = ", ".join(map(repr, filter(None, (name, subset))))
    return (f"where the Hub is reachable, save it as JSON lines: python -c \"import datasets; datasets.load_dataset("
            f"{args}, split={split!r}).select_columns({list(columns)!r}).to_json({file!r}, lines=True)\", then copy "
            f"{file} here and pass --{key}={file}")


def hub_rows(spec: str, key: str, columns: tuple[str, ...], form: str, file: str) -> Any:
    """The `datasets.Dataset` that `spec` (config `key`'s value, `hf:NAME[:SUBSET[:SPLIT]]`) names, which has
    `columns` (`form` says what they hold, for the error when one is missing); otherwise a UserError of one line,
    naming the local-file route (`hub_route`, to `file`) where the library is missing or the Hub cannot be reached."""
    name, subset, split = (*spec.removeprefix("hf:").split(":"), None, None)[:3]
    subset, split = subset or None, split or "train"
    if not name:
        raise UserError(f"{key}={spec!r}: name a dataset, {HUB_SPEC}")
    route = hub_route(name, subset, split, columns, key, file)
    try:
        import datasets
    except ImportError:
        raise UserError(f"{key}={spec}: reading a Hub dataset needs the `datasets` library (pip install datasets); "
                        f"or, {route}") from None
    try:
        rows = datasets.load_dataset(name, subset, split=split)
    except ConnectionError:
        raise UserError(f"{key}={spec}: the Hugging Face Hub cannot be reached from here (offline); {route}") from None
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as e:
        message = one_line(e)
        raise UserError(f"{key}={spec}: {message} (the form is {HUB_SPEC})") from None
    missing = [c for c in columns if c not in rows.column_names]
    if missing:
        raise UserError(f"{key}={spec} has columns {rows.column_names}, no {', '.join(map(repr, missing))}: {form}")
    return rows
