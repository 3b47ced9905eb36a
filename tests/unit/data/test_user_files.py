"""The one reader of the files users hand in: each failure one line naming the file (and line) and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxgpt.data import user_files
from jaxgpt.errors import UserError


def test_values_come_with_their_file_and_line_and_blank_lines_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"a": 1}\n\n  \n[2, "x"]\r\n"\xc3\xa9"\n')  # a byte-order mark, CRLF, UTF-8
    assert user_files.jsonl_objects(path) == [(f"{path}:1", {"a": 1}), (f"{path}:4", [2, "x"]), (f"{path}:5", "é")]


@pytest.mark.parametrize(("content", "message"), [
    (b'{"a": 1}\n{"a": \n', r"rows.jsonl:2: not valid JSON \(Expecting value at column 7\): write one JSON object"),
    (b'{"a": 1}\n\xff\n', r"--data .*rows.jsonl is not UTF-8 text \(bad byte at offset 9\): convert it to UTF-8"),
])
def test_a_bad_file_is_one_line_naming_where(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_bytes(content)
    with pytest.raises(UserError, match=message) as info:
        user_files.jsonl_objects(path, "--data")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("make", [lambda p: None, lambda p: p.mkdir()], ids=["missing", "a directory"])
def test_a_file_that_cannot_be_read_is_one_line(tmp_path: Path, make) -> None:
    path = tmp_path / "prompt.txt"
    make(path)
    with pytest.raises(UserError, match=rf"^cannot read --prompt_file {path} \(.+\): check the path$"):
        user_files.read_text(path, "--prompt_file")
