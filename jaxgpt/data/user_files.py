"""Reading the files a user hands in whole: prompts, texts to score, conversations, preference pairs, source/target
pairs, labelled examples, benchmark JSONL.

One rule for what goes wrong in any of them, so that every command says it the same way: a file that cannot be read,
one that is not UTF-8 and a JSONL line that is not JSON are each one line naming the file (and the line) and the fix.
A byte-order mark is dropped, as spreadsheet programs write one and a JSON parser refuses it. Large corpora are
streamed by `jaxgpt.data.sources` instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jaxgpt.errors import UserError


def read_text(path: str | Path, what: str = "") -> str:
    """The whole UTF-8 text of `path`; `what` (a flag, say) names the file in the error before its path."""
    name = f"{what} {path}".strip()
    try:
        return Path(path).read_bytes().decode("utf-8-sig")
    except OSError as e:
        raise UserError(f"cannot read {name} ({e.strerror or e}): check the path") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{name} is not UTF-8 text (bad byte at offset {e.start}): convert it to UTF-8") from None


def jsonl_objects(path: str | Path, what: str = "") -> list[tuple[str, Any]]:
    """("FILE:LINE", value) of every non-blank line of a .jsonl file, the location for the caller's own checks of each
    value; a line that is not JSON is a UserError at its FILE:LINE."""
    return parse_jsonl(read_text(path, what), path)


def parse_jsonl(text: str, path: str | Path) -> list[tuple[str, Any]]:
    """`jsonl_objects` of a file's text already read (`path` names it in the locations)."""
    values = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            values.append((f"{path}:{n}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno}): write one JSON object "
                            "a line") from None
    return values
