"""Corpus-scale data: parallel streaming preparation into shards, resumable; other trainers' token files;
ids past uint16; document-aligned windows."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
from helpers.corpus import WORDS, corpus, llmc_shard, shard_bytes

from jaxgpt.data import prepare as prep
from jaxgpt.data import sources
from jaxgpt.data.batches import batch_for_step, document_starts
from jaxgpt.data.dataset import load_dataset
from jaxgpt.data.tokenizer import WordTokenizer, load_bpe
from jaxgpt.data.tokens import LLMC_MAGIC
from jaxgpt.errors import UserError


def test_workers_give_byte_identical_shards_equal_to_whole_text_ids(tmp_path, gpt2, monkeypatch):
    monkeypatch.setattr(sources, "PIECE_CHARS", 5_000)  # cut the long file into many pieces
    monkeypatch.setattr(prep, "TASK_CHARS", 20_000)
    files = corpus(tmp_path / "text")
    one = prep.prepare_text(files, tmp_path / "one", gpt2, workers=1, shard_tokens=7_000)
    two = prep.prepare_text(files, tmp_path / "two", gpt2, workers=2, shard_tokens=7_000)
    assert len(one["shards"]) > 3 and one == {**two, "source": one["source"]}
    assert shard_bytes(tmp_path / "one") == {**shard_bytes(tmp_path / "two"), "meta.json": (tmp_path / "one" /
                                                                                         "meta.json").read_bytes()}
    # The pieces tokenize to the ids of whole documents, with end-of-text between documents.
    texts = [p.read_text() for p in files[:3]]
    texts += [json.loads(line)["text"] for line in files[3].read_text().splitlines()]
    import pyarrow.parquet as pq

    texts += pq.read_table(files[4]).column("text").to_pylist()
    want = gpt2.encode("<|endoftext|>".join(texts))
    ds = load_dataset(tmp_path / "one")
    assert np.concatenate([ds.train, ds.val]).tolist() == want


@pytest.mark.parametrize(("magic", "version", "cut", "message"), [
    (12345, 1, 0, "magic 12345"), (LLMC_MAGIC, 7, 0, "version 7"), (LLMC_MAGIC, 1, 2, "truncated")])
def test_corrupted_llmc_header_is_a_one_line_error_naming_the_file(tmp_path, magic, version, cut, message):
    llmc_shard(tmp_path / "x_val_000000.bin", np.arange(100))
    llmc_shard(tmp_path / "x_train_000001.bin", np.arange(100), magic, version)
    if cut:
        path = tmp_path / "x_train_000001.bin"
        path.write_bytes(path.read_bytes()[:-cut])
    with pytest.raises(UserError, match=message) as err:
        load_dataset(tmp_path)
    assert "x_train_000001.bin" in str(err.value) and "\n" not in str(err.value)


def test_nanogpt_files_read_as_they_are(tmp_path):
    chars = "\n !abc"
    text = "abc cab!\n" * 50
    ids = np.array([chars.index(c) for c in text], "<u2")
    ids[:400].tofile(tmp_path / "train.bin")
    ids[400:].tofile(tmp_path / "val.bin")
    meta = {"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": {c: i for i, c in enumerate(chars)}}
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps(meta))
    ds = load_dataset(tmp_path)
    assert ds.tokenizer.decode(np.concatenate([ds.train, ds.val]).tolist()) == text
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps({"itos": {0: Path("x")}}))  # not plain data: never loaded
    with pytest.raises(UserError, match="not a nanoGPT character vocabulary"):
        load_dataset(tmp_path)


def test_document_aligned_windows_start_at_boundaries(tmp_path):
    rng = np.random.default_rng(1)
    docs = [" ".join(rng.choice(WORDS, int(rng.integers(3, 40)))) for _ in range(300)]
    words = WordTokenizer.from_texts(docs, 50)
    prep.prepare_text(docs, tmp_path / "ds", words, val_fraction=0.2)
    ds = load_dataset(tmp_path / "ds")
    eot = ds.eot_token
    starts = document_starts(ds.train.boundaries(eot), len(ds.train), 16)
    tokens = np.asarray(ds.train)
    assert starts[0] == 0 and all(tokens[s] == eot for s in starts[1:])
    assert len(starts) == np.count_nonzero(tokens[:len(tokens) - 16] == eot) + 1
    for step in range(20):
        x, y = batch_for_step(ds.train, seed=3, step=step, batch_size=8, block_size=16, starts=starts)
        again, _ = batch_for_step(ds.train, seed=3, step=step, batch_size=8, block_size=16, starts=starts)
        assert np.array_equal(x, again)  # a pure function of (seed, step)
        assert all(row[0] == eot or np.array_equal(row, tokens[:16]) for row in x)
        assert np.array_equal(x[:, 1:], y[:, :-1])


def test_larger_tiktoken_encodings_offline_are_one_line_errors(tmp_path, monkeypatch):
    """cl100k_base / o200k_base take their ranks file from --bpe_file offline; a missing or wrong file is one line
    naming where to get the right one (the ranks themselves are not available to tests: no network)."""
    from jaxgpt.commands import data as data_command

    monkeypatch.setenv("JAXGPT_CACHE", str(tmp_path / "cache"))
    with pytest.raises(UserError, match=r"cannot read BPE ranks file .*cl100k_base\.tiktoken"):
        load_bpe("cl100k_base", tmp_path / "missing")
    wrong = tmp_path / "o200k_base.tiktoken"
    wrong.write_text("not the ranks\n")
    with pytest.raises(UserError, match=r"is not o200k_base.s .*o200k_base\.tiktoken"):
        load_bpe("o200k_base", wrong)
    assert not (tmp_path / "cache").exists()
    text = tmp_path / "t.txt"
    text.write_text("hello")
    code = data_command.main(["jaxgpt data", f"--text={text}", "--tokenizer=cl100k_base", f"--bpe_file={wrong}",
                              f"--out={tmp_path / 'ds'}"])
    assert code == 2 and not (tmp_path / "ds").exists()
