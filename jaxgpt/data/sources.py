"""Where a corpus's text comes from, as a stream of pieces that never holds a whole file in memory.

A stream is `(starts_document, text)` pairs: a document is one text file, one JSONL line's or Parquet row's
text column, one text given in Python, or one record of a Hugging Face dataset. Long documents are cut
into pieces right after a newline that a non-space character follows: no tokenizer here (characters, words,
GPT-2's or tiktoken's other BPEs) merges across such a point, so the pieces tokenize to exactly the ids of
the whole text, and workers can tokenize the pieces of one huge file in parallel.
"""

from __future__ import annotations

import codecs
import glob
import json
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

from jaxgpt.errors import UserError, optional_import

Piece = tuple[bool, str]  # (the first piece of a document, its text)
PIECE_CHARS = 1 << 20  # a long document is cut near every this many characters
READ_BYTES = 1 << 20
_CUT = re.compile(r"\n(?=\S)")


def cut(text: str, final: bool = True) -> tuple[list[str], str]:
    """`text` as pieces of about PIECE_CHARS, and the rest that is not yet a piece (`final`: nothing is)."""
    pieces, start = [], 0
    while len(text) - start > PIECE_CHARS:
        match = _CUT.search(text, start + PIECE_CHARS)
        if match is None:
            break
        pieces.append(text[start:match.end()])
        start = match.end()
    rest = text[start:]
    if final:
        return [*pieces, rest], ""
    return pieces, rest


def _file_pieces(path: Path) -> Iterator[str]:
    """A UTF-8 text file's pieces, read a block at a time."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    pending, offset = "", 0
    try:
        with open(path, "rb") as f:
            while block := f.read(READ_BYTES):
                pieces, pending = cut(pending + decoder.decode(block), final=False)
                offset += len(block)
                yield from pieces
            pieces, _ = cut(pending + decoder.decode(b"", final=True))
            yield from pieces
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text (bad byte near offset {offset + e.start}): convert it to "
                        "UTF-8") from None
    except OSError as e:
        raise UserError(f"cannot read text file {path} ({e.strerror}): check the path") from None


def _document(text: str) -> Iterator[Piece]:
    for i, piece in enumerate(cut(text)[0]):
        yield i == 0, piece


def _jsonl_texts(path: Path, field: str) -> Iterator[str]:
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line).get(field) if line.lstrip().startswith("{") else None
                except json.JSONDecodeError:
                    text = None
                if not isinstance(text, str):
                    raise UserError(f"{path}:{n} is not a JSON object with a string {field!r} field: fix the "
                                    "line, or name the text column with --text_field")
                yield text
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text: convert it to UTF-8") from None


def _parquet_texts(path: Path, field: str) -> Iterator[str]:
    pq = optional_import("pyarrow.parquet", f"reading {path}", package="pyarrow")
    try:
        parquet = pq.ParquetFile(path)
        if field not in parquet.schema_arrow.names:
            raise UserError(f"{path} has no {field!r} column (it has {parquet.schema_arrow.names}): name the text "
                            "column with --text_field")
        for batch in parquet.iter_batches(columns=[field], batch_size=1024):
            yield from (text or "" for text in batch.column(0).to_pylist())
    except OSError as e:
        raise UserError(f"cannot read {path} as Parquet ({e}): check the file") from None


def expand(paths: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Files, directories (every file below, sorted) and glob patterns, as files in a fixed order."""
    files = []
    for item in paths:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        elif glob.has_magic(str(item)):
            found = sorted(Path(p) for p in glob.glob(str(item), recursive=True) if Path(p).is_file())
        else:
            found = [path]
        if not found:
            raise UserError(f"{item} matches no file: check the path or pattern")
        files += found
    return files


def text_stream(items: Sequence[str | os.PathLike[str]], text_field: str = "text") -> Iterator[Piece]:
    """The pieces of `items`: `str` items are texts, path items are files, directories or globs (.jsonl and
    .parquet files hold one document per record in `text_field`; any other file is one document)."""
    for item in items:
        if isinstance(item, str):
            yield from _document(item)
            continue
        for path in expand([item]):
            if path.suffix == ".jsonl":
                for text in _jsonl_texts(path, text_field):
                    yield from _document(text)
            elif path.suffix == ".parquet":
                for text in _parquet_texts(path, text_field):
                    yield from _document(text)
            else:
                for i, piece in enumerate(_file_pieces(path)):
                    yield i == 0, piece


def hub_stream(repo: str, config: str | None, text_field: str = "text", max_documents: int | None = None
               ) -> Iterator[Piece]:
    """The pieces of a Hugging Face Hub dataset's train split, streamed (nothing is downloaded whole)."""
    datasets = optional_import("datasets", f"streaming {repo} from the Hugging Face Hub",
                               otherwise="prepare local files with --text FILE...")
    try:
        stream = datasets.load_dataset(repo, name=config, split="train", streaming=True)
        for i, row in enumerate(stream):
            if max_documents is not None and i >= max_documents:
                return
            yield from _document(row[text_field])
    except Exception as e:  # network, auth and missing-dataset errors come from several libraries
        raise UserError(f"streaming {repo} ({config}) from the Hugging Face Hub failed ({type(e).__name__}: {e}): "
                        "check network access to huggingface.co, or prepare local files with --text FILE... "
                        "(JSONL or Parquet with a text column work as they are)") from e
