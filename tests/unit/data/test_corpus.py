"""Corpus-scale data: parallel streaming preparation into shards, resumable; other trainers' token files;
ids past uint16; document-aligned windows."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT
from helpers.runs import final_params, run_train, train_cmd, train_losses

from jaxgpt.data import prepare as prep
from jaxgpt.data import sources
from jaxgpt.data.batches import batch_for_step, document_starts
from jaxgpt.data.dataset import load_dataset
from jaxgpt.data.tokenizer import WordTokenizer, load_bpe
from jaxgpt.data.tokens import LLMC_HEADER_INTS, LLMC_MAGIC
from jaxgpt.errors import UserError

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


@pytest.fixture(scope="module")
def gpt2() -> object:
    if not os.environ.get("JAXGPT_BPE_FILE"):
        pytest.skip("needs the GPT-2 ranks offline (JAXGPT_BPE_FILE, see .ci/provision_bpe.sh)")
    return load_bpe("gpt2")


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


def test_kill_mid_preparation_then_the_same_command_gives_the_uninterrupted_output(tmp_path, gpt2):
    files = corpus(tmp_path / "text", n_files=2, words=600_000)
    command = [sys.executable, "-m", "jaxgpt", "data", "--text", *map(str, files), "--tokenizer", "gpt2",
               "--workers", "1", "--shard_tokens", "50000"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([*command, "--out", str(tmp_path / "straight")], check=True, env=env, timeout=300,
                   capture_output=True)
    out, progress = tmp_path / "killed", tmp_path / ".killed.preparing" / "progress.jsonl"
    proc = subprocess.Popen([*command, "--out", str(out)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (progress.exists() and len(progress.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.time() < deadline, "preparation ended before two shards"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    resumed = subprocess.run([*command, "--out", str(out)], env=env, timeout=300, capture_output=True, text=True)
    assert resumed.returncode == 0 and "resuming: " in resumed.stderr, resumed.stderr[-2000:]
    straight_meta = json.loads((tmp_path / "straight" / "meta.json").read_text())
    assert json.loads((out / "meta.json").read_text())["shards"] == straight_meta["shards"]
    assert {k: v for k, v in shard_bytes(out).items() if k != "meta.json"} == {
        k: v for k, v in shard_bytes(tmp_path / "straight").items() if k != "meta.json"}
    assert not (tmp_path / ".killed.preparing").exists()


def llmc_shard(path: Path, tokens: np.ndarray, magic: int = LLMC_MAGIC, version: int = 1) -> None:
    header = np.zeros(LLMC_HEADER_INTS, "<i4")
    header[:3] = magic, version, len(tokens)
    path.write_bytes(header.tobytes() + tokens.astype("<u2").tobytes())


def test_llmc_shards_train_and_resume_bit_exact(tmp_path):
    rng = np.random.default_rng(0)
    data = tmp_path / "fineweb10B"
    data.mkdir()
    for name, n in [("fineweb_val_000000.bin", 3_000), ("fineweb_train_000001.bin", 5_000),
                    ("fineweb_train_000002.bin", 4_000)]:
        llmc_shard(data / name, rng.integers(0, 50257, n))
    ds = load_dataset(data)
    assert (len(ds.train), len(ds.val), ds.meta["vocab_size"]) == (9_000, 3_000, 50257)
    cache = str(tmp_path / "xla")
    steps = ["--config.max_steps=20", "--config.optim.decay_steps=20", "--config.ckpt_interval=10",
             "--config.eval_interval=10", "--config.batch_size=4"]
    run_train(*train_cmd(tmp_path / "straight", data, cache, *steps))
    run_train(*train_cmd(tmp_path / "halves", data, cache, *steps, "--config.max_steps=10"))
    resumed = run_train(*train_cmd(tmp_path / "halves", data, cache, *steps))
    assert "resuming at step 10" in resumed.stdout
    want, got = final_params(tmp_path / "straight"), final_params(tmp_path / "halves")
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=str(k))
    assert train_losses(tmp_path / "halves") == train_losses(tmp_path / "straight")


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
    from jaxgpt.data import tokenizer as tok

    monkeypatch.setattr(tok, "TIKTOKEN_CACHE", tmp_path / "cache")
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
