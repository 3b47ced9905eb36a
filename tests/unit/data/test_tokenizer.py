"""Tokenizers: reference GPT-2 ids, lossless round trips, and clear errors for every missing/bad input."""

import os
import time
from pathlib import Path

import pytest
import tiktoken

from jaxgpt.data import tokenizer as tok
from jaxgpt.data.tokenizer import BPE_FILE_ENV, R50K_SHA256, CharTokenizer, load_bpe, tokenizer_from_meta
from jaxgpt.errors import UserError

ROUND_TRIP_TEXTS = [
    "A long time ago",
    "héllo wörld, naïve café",
    "emoji 🤖🎉 and a family 👩‍👩‍👧 and flags 🇫🇷",
    "  leading and trailing spaces  ",
    "tabs\tand\n\nnewlines\r\n and \u00a0 non-breaking",
    "中文字符 日本語 한국어 العربية",
    "",
    "doc one<|endoftext|>doc two <|endoftext|>",
]


def _bpe_file() -> Path | None:
    """The configured or provisioned ranks file, if one exists."""
    for candidate in (os.environ.get(BPE_FILE_ENV), tok.DEFAULT_BPE_FILE):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


@pytest.fixture(scope="module")
def bpe_file() -> Path | None:
    return _bpe_file()


@pytest.fixture(scope="module")
def gpt2(bpe_file):
    """GPT-2 BPE from the ranks file, else from tiktoken's cache; skip only when neither has it."""
    if bpe_file is not None:
        return load_bpe("gpt2", bpe_file)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(BPE_FILE_ENV, raising=False)
        try:
            return load_bpe("gpt2")
        except UserError:
            pytest.skip(f"GPT-2 BPE ranks unavailable (no {BPE_FILE_ENV}, nothing provisioned, not in "
                        "tiktoken's cache): run .ci/provision_bpe.sh")


def _offline(monkeypatch, tmp_path) -> Path:
    """No configured file, an empty tiktoken cache, no in-process encodings, and every HTTPS request
    refused at once (a proxy on a closed port), so the test behaves the same with or without internet."""
    monkeypatch.delenv(BPE_FILE_ENV, raising=False)
    monkeypatch.setattr(tok, "DEFAULT_BPE_FILE", tmp_path / "absent" / "gpt2.tiktoken")
    cache = tmp_path / "tiktoken-cache"
    cache.mkdir()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    for var in ("HTTPS_PROXY", "https_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    for var in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
    return cache


# ---------------------------------------------------------------------------------------------- BPE


def test_gpt2_reference_ids(gpt2):
    assert gpt2.encode("A long time ago") == [32, 890, 640, 2084]
    assert gpt2.encode("she") == [7091]
    assert gpt2.encode("her") == [372]
    assert (gpt2.vocab_size, gpt2.eot_token, gpt2.name) == (50257, 50256, "gpt2")


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_gpt2_round_trip(gpt2, text):
    assert gpt2.decode(gpt2.encode(text)) == text


def test_gpt2_endoftext_literal_is_the_eot_token(gpt2):
    assert gpt2.encode("<|endoftext|>") == [50256]
    assert gpt2.encode("a<|endoftext|>b") == [64, 50256, 65]
    assert gpt2.decode([50256]) == "<|endoftext|>"


def test_gpt2_meta_round_trip(gpt2, bpe_file):
    meta = gpt2.to_meta()
    assert meta == {"type": "bpe", "encoding": "gpt2", "vocab_size": 50257}
    again = tokenizer_from_meta(meta, bpe_file)
    assert again.encode("A long time ago") == [32, 890, 640, 2084]


def test_r50k_base_is_the_same_tokenizer(gpt2, bpe_file):
    r50k = load_bpe("r50k_base", bpe_file)
    assert r50k.name == "r50k_base"
    for text in ROUND_TRIP_TEXTS:
        assert r50k.encode(text) == gpt2.encode(text)


def test_explicit_file_beats_env_and_env_is_used(gpt2, bpe_file, tmp_path, monkeypatch):
    if bpe_file is None:
        pytest.skip("needs a GPT-2 ranks file (JAXGPT_BPE_FILE or .ci/provision_bpe.sh)")
    bogus = tmp_path / "bogus.tiktoken"
    bogus.write_bytes(b"not ranks\n")
    monkeypatch.setenv(BPE_FILE_ENV, str(bogus))
    assert load_bpe("gpt2", bpe_file).encode("she") == [7091]
    monkeypatch.setenv(BPE_FILE_ENV, str(bpe_file))
    assert load_bpe("gpt2").encode("her") == [372]


def test_loading_a_file_leaves_tiktoken_cache_alone(gpt2, bpe_file, tmp_path, monkeypatch):
    if bpe_file is None:
        pytest.skip("needs a GPT-2 ranks file (JAXGPT_BPE_FILE or .ci/provision_bpe.sh)")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    load_bpe("gpt2", bpe_file)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("via", ["argument", "env"])
def test_wrong_hash_file_is_a_user_error(tmp_path, monkeypatch, via):
    bad = tmp_path / "gpt2.tiktoken"
    bad.write_bytes(b"IQ== 0\n")
    monkeypatch.setenv(BPE_FILE_ENV, str(bad) if via == "env" else "")
    with pytest.raises(UserError) as err:
        load_bpe("gpt2", bad if via == "argument" else None)
    assert str(bad) in str(err.value) and R50K_SHA256 in str(err.value)


def test_missing_configured_file_is_a_user_error(tmp_path, monkeypatch):
    monkeypatch.setenv(BPE_FILE_ENV, str(tmp_path / "nope.tiktoken"))
    with pytest.raises(UserError, match=r"nope\.tiktoken"):
        load_bpe("gpt2")


def test_offline_without_cache_fails_fast_with_the_fix(tmp_path, monkeypatch):
    cache = _offline(monkeypatch, tmp_path)
    started = time.perf_counter()
    with pytest.raises(UserError) as err:
        load_bpe("gpt2")
    assert time.perf_counter() - started < 10
    message = str(err.value)
    assert BPE_FILE_ENV in message and "--bpe_file" in message and "openai-whisper==20250625" in message
    assert "\n" not in message
    assert list(cache.iterdir()) == []


def test_unknown_bpe_encoding_is_a_user_error():
    with pytest.raises(UserError, match="cl100k_base"):
        load_bpe("cl100k_base")


# --------------------------------------------------------------------------------------------- char


def test_char_vocabulary_is_the_sorted_characters():
    t = CharTokenizer.from_text("hello, world")
    assert t.chars == " ,dehlorw"
    assert (t.vocab_size, t.eot_token, t.name) == (9, None, "char")
    assert t.encode("hello") == [4, 3, 5, 5, 6]


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_char_round_trip(text):
    t = CharTokenizer.from_text("".join(ROUND_TRIP_TEXTS))
    assert t.decode(t.encode(text)) == text


def test_char_out_of_vocabulary_names_the_characters():
    t = CharTokenizer.from_text("abc")
    with pytest.raises(UserError) as err:
        t.encode("abé€cab\U0001f916")
    message = str(err.value)
    assert "'é'" in message and "'€'" in message and "'🤖'" in message and "3-character" in message


def test_char_out_of_vocabulary_lists_only_the_first_few():
    t = CharTokenizer.from_text("a")
    with pytest.raises(UserError, match="and 5 more"):
        t.encode("a0123456789")


def test_char_meta_round_trip():
    t = CharTokenizer.from_text("the quick brown fox 🦊")
    again = tokenizer_from_meta(t.to_meta())
    assert isinstance(again, CharTokenizer) and again.chars == t.chars
    assert again.encode("fox 🦊") == t.encode("fox 🦊")


def test_char_decode_rejects_out_of_range_ids():
    t = CharTokenizer.from_text("ab")
    with pytest.raises(ValueError, match="outside"):
        t.decode([0, 2])
    with pytest.raises(ValueError, match="outside"):
        t.decode([-1])


@pytest.mark.parametrize(
    "meta",
    [{"type": "char", "chars": "ba"}, {"type": "char", "chars": "aa"}, {"type": "char", "chars": ""},
     {"type": "char"}, {"type": "wordpiece"}, {}],
)
def test_bad_tokenizer_meta_is_a_user_error(meta):
    with pytest.raises(UserError):
        tokenizer_from_meta(meta)
