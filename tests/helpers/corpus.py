"""Corpora for the data tests: random sentences in text, JSONL and Parquet files, and llm.c's token shards."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxgpt.data.tokens import LLMC_HEADER_INTS, LLMC_MAGIC

WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far", "away", "é", "über", "—", "42"]


def corpus(root: Path, n_files: int = 3, words: int = 20_000, seed: int = 0) -> list[Path]:
    """A few text files, a JSONL file and a Parquet file of random sentences, one file much longer."""
    rng = np.random.default_rng(seed)
    lines = lambda n: "".join(" ".join(rng.choice(WORDS, 12)) + ".\n" for _ in range(n))
    root.mkdir(parents=True, exist_ok=True)
    files = []
    for i in range(n_files):
        path = root / f"doc{i}.txt"
        path.write_text(lines(words // 12 * (4 if i == 0 else 1)), encoding="utf-8")
        files.append(path)
    (root / "records.jsonl").write_text("".join(json.dumps({"text": lines(3), "id": i}) + "\n" for i in range(40)))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [lines(2) for _ in range(30)]}), root / "records.parquet")
    return [*files, root / "records.jsonl", root / "records.parquet"]


def shard_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def llmc_shard(path: Path, tokens: np.ndarray, magic: int = LLMC_MAGIC, version: int = 1) -> None:
    header = np.zeros(LLMC_HEADER_INTS, "<i4")
    header[:3] = magic, version, len(tokens)
    path.write_bytes(header.tobytes() + tokens.astype("<u2").tobytes())
