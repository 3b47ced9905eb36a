"""Data preparation, validation on load, and the stateless loader that exact resume relies on."""

import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import tiktoken

from jaxgpt import storage
from jaxgpt.commands import data as data_command
from jaxgpt.data import corpora as datasets
from jaxgpt.data import dataset as data
from jaxgpt.data import streams
from jaxgpt.data import tokenizer as tok
from jaxgpt.data.batches import batch_for_step, eval_batches, filler_batches
from jaxgpt.data.corpora import prepare_builtin
from jaxgpt.data.dataset import load_dataset
from jaxgpt.data.prepare import prepare_text
from jaxgpt.data.sources import hub_stream
from jaxgpt.data.tokenizer import CharTokenizer, load_bpe
from jaxgpt.errors import UserError

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 20
VOCAB = "".join(sorted(set(TEXT)))
SHARD = "tokens_000000.bin"  # the one shard of a small dataset


@pytest.fixture
def prepared(tmp_path) -> Path:
    out = tmp_path / "ds"
    prepare_text([TEXT], out)
    return out


def _bin_bytes(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in directory.iterdir()}


# ------------------------------------------------------------------------------------------ prepare


def test_prepare_char_writes_uint16_splits_and_meta(prepared):
    meta = json.loads((prepared / "meta.json").read_text())
    n_val = int(len(TEXT) * 0.1)
    assert meta["format_version"] == 2
    assert meta["dtype"] == "uint16"
    assert (meta["n_train"], meta["n_val"]) == (len(TEXT) - n_val, n_val)
    assert meta["tokenizer"] == {"type": "char", "chars": VOCAB, "vocab_size": len(VOCAB)}
    assert meta["vocab_size"] == len(VOCAB)
    assert meta["source"]
    assert [s["file"] for s in meta["shards"]] == ["tokens_000000.bin"]
    assert meta["shards"][0]["sha256"] == storage.sha256_file(prepared / "tokens_000000.bin")
    assert (prepared / "tokens_000000.bin").stat().st_size == 2 * len(TEXT) == 2 * meta["shards"][0]["tokens"]
    assert [p.name for p in prepared.parent.iterdir()] == ["ds"]  # no workspace or lock left


def test_prepared_splits_decode_to_the_text_in_order(prepared):
    ds = load_dataset(prepared)
    assert ds.train.dtype == np.uint16 and ds.val.dtype == np.uint16
    n_train = len(ds.train)
    assert ds.tokenizer.decode(ds.train.tolist()) == TEXT[:n_train]
    assert ds.tokenizer.decode(ds.val.tolist()) == TEXT[n_train:]


def test_prepare_reads_path_items_as_files_and_concatenates(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_bytes("alpha é\r\n".encode() * 10)
    b.write_bytes(b"beta\n" * 10)
    meta = prepare_text([a, b], tmp_path / "ds", val_fraction=0.2)
    ds = load_dataset(tmp_path / "ds")
    text = ds.tokenizer.decode(np.concatenate([ds.train, ds.val]).tolist())
    assert text == (a.read_bytes() + b.read_bytes()).decode()  # "\r\n" kept as is
    assert str(a) in meta["source"] and str(b) in meta["source"]


def test_prepare_bpe_separates_documents_with_eot(tmp_path):
    try:
        gpt2 = load_bpe("gpt2")
    except UserError:
        pytest.skip("GPT-2 BPE ranks unavailable: run .ci/provision_bpe.sh")
    docs = ["A long time ago " * 5, "she said to her " * 5]
    meta = prepare_text(docs, tmp_path / "ds", gpt2)
    ds = load_dataset(tmp_path / "ds")
    tokens = np.concatenate([ds.train, ds.val]).tolist()
    assert tokens == [*gpt2.encode(docs[0]), 50256, *gpt2.encode(docs[1])]
    assert meta["tokenizer"]["type"] == "bpe" and meta["vocab_size"] == 50257


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5])
def test_bad_val_fraction_is_a_user_error(tmp_path, fraction):
    with pytest.raises(UserError, match="val_fraction"):
        prepare_text([TEXT], tmp_path / "ds", val_fraction=fraction)


def test_tiny_or_empty_corpus_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="too few"):
        prepare_text(["abcd"], tmp_path / "ds")
    with pytest.raises(UserError, match="no text"):
        prepare_text(["", ""], tmp_path / "ds")
    assert not (tmp_path / "ds" / "meta.json").exists()


def test_output_path_that_is_a_file_is_a_user_error(tmp_path):
    (tmp_path / "taken").write_text("a file")
    with pytest.raises(UserError, match="output directory"):
        prepare_text([TEXT], tmp_path / "taken")


def test_missing_or_non_utf8_text_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="cannot read"):
        prepare_text([tmp_path / "absent.txt"], tmp_path / "ds")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café".encode("latin-1"))
    with pytest.raises(UserError, match="not UTF-8"):
        prepare_text([latin1], tmp_path / "ds")


def test_vocabulary_beyond_uint16_is_stored_as_uint32(tmp_path):
    """70,000 words: ids past 65,535 survive the token files (uint32) and decode back to the text."""
    words = [f"w{i}" for i in range(70_000 - 2)]
    text = " ".join(words[::-1])
    meta = prepare_text([text], tmp_path / "ds", tok.WordTokenizer(words), val_fraction=0.01)
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_000
    ds = load_dataset(tmp_path / "ds")
    ids = np.concatenate([ds.train, ds.val])
    assert ids.dtype == np.uint32 and ids.max() == 70_000 - 1
    assert ds.tokenizer.decode(ids.tolist()) == text


def test_existing_different_dataset_is_not_overwritten(prepared):
    before = _bin_bytes(prepared)
    with pytest.raises(UserError, match="overwrite"):
        prepare_text([TEXT.upper()], prepared)
    assert _bin_bytes(prepared) == before
    load_dataset(prepared)
    prepare_text([TEXT], prepared)  # the same content again is fine
    assert _bin_bytes(prepared) == before
    prepare_text([TEXT.upper()], prepared, overwrite=True)
    replaced = load_dataset(prepared)
    assert replaced.tokenizer.decode(replaced.val.tolist()).isupper()


def test_unreadable_existing_meta_needs_overwrite(prepared):
    (prepared / "meta.json").write_text("{not json")
    with pytest.raises(UserError, match="overwrite"):
        prepare_text([TEXT], prepared)
    prepare_text([TEXT], prepared, overwrite=True)
    load_dataset(prepared)


def test_failure_while_tokenizing_keeps_the_old_dataset(prepared):
    class Failing(CharTokenizer):
        def encode_array(self, text):
            raise RuntimeError("tokenizer crashed")

    before = _bin_bytes(prepared)
    with pytest.raises(RuntimeError):
        prepare_text([TEXT.upper()], prepared, Failing("ABC"), overwrite=True)
    assert _bin_bytes(prepared) == before
    assert sorted(p.name for p in prepared.iterdir()) == ["meta.json", "tokens_000000.bin"]


def test_interrupted_commit_never_leaves_a_valid_looking_mix(prepared, monkeypatch):
    real_replace, calls = os.replace, []

    def replace_then_die(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt  # killed after train.bin was swapped in, before val.bin and meta.json
        real_replace(src, dst)

    monkeypatch.setattr(data.os, "replace", replace_then_die)
    with pytest.raises(KeyboardInterrupt):
        prepare_text([TEXT.upper()], prepared, overwrite=True)
    monkeypatch.undo()
    with pytest.raises(UserError, match="not a prepared dataset"):
        load_dataset(prepared)
    prepare_text([TEXT.upper()], prepared)  # no meta.json left, so no overwrite needed to finish the job
    load_dataset(prepared)


# ------------------------------------------------------------------------------------ built-ins


def _fake_stdlib(root: Path) -> None:
    files = {
        "zeta.py": "z = 1\n",
        "alpha.py": "a = 'é'\n",
        "pkg/__init__.py": "",
        "pkg/mod.py": "def f():\n    return 2",
        "pkg/__pycache__/mod.py": "cached = True\n",
        "test/test_x.py": "excluded\n",
        "pkg/tests/t.py": "excluded\n",
        "idlelib/idle_test/t.py": "excluded\n",
        "lib2to3/tests/data/t.py": "excluded\n",
        "site-packages/thirdparty.py": "excluded\n",
        "notes.txt": "not python\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "broken.py").write_bytes(b"x = '\xff'\n")


def test_stdlib_corpus_selection_order_and_headers(tmp_path):
    _fake_stdlib(tmp_path)
    text, description = datasets.stdlib_corpus(tmp_path)
    assert text == (
        "# file: alpha.py\na = 'é'\n\n"
        "# file: pkg/__init__.py\n\n"
        "# file: pkg/mod.py\ndef f():\n    return 2\n"
        "# file: zeta.py\nz = 1\n"
    )
    assert "4 .py files" in description and "1 skipped" in description


def test_stdlib_char_is_deterministic_on_a_small_tree(tmp_path, monkeypatch):
    root = tmp_path / "lib"
    _fake_stdlib(root)
    (root / "big.py").write_text("x = [i * 2 for i in range(10)]\n" * 50)
    monkeypatch.setattr(datasets, "stdlib_root", lambda: root)
    meta_a = prepare_builtin("stdlib_char", tmp_path / "a")
    meta_b = prepare_builtin("stdlib_char", tmp_path / "b")
    assert meta_a == meta_b
    assert _bin_bytes(tmp_path / "a") == _bin_bytes(tmp_path / "b")
    assert meta_a["tokenizer"]["type"] == "char"


def test_stdlib_char_real_library_is_deterministic(tmp_path):
    """The embedded default corpus: the interpreter's own standard library (about 12 M characters)."""
    meta_a = prepare_builtin("stdlib_char", tmp_path / "a")
    meta_b = prepare_builtin("stdlib_char", tmp_path / "b")
    assert meta_a == meta_b
    assert meta_a["n_train"] + meta_a["n_val"] > 1_000_000
    assert meta_a["vocab_size"] < 65536
    ds = load_dataset(tmp_path / "a")
    assert ds.tokenizer.decode(ds.train[:8].tolist()) == "# file: "


def test_shakespeare_download_failure_says_how_to_use_a_local_file(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets, "SHAKESPEARE_URL", "http://127.0.0.1:9/input.txt")  # refused at once
    with pytest.raises(UserError) as err:
        prepare_builtin("shakespeare_char", tmp_path / "sh")
    assert "download" in str(err.value) and "jaxgpt data --text input.txt --tokenizer char" in str(err.value)
    assert not (tmp_path / "sh" / "input.txt").exists()


def test_shakespeare_uses_an_already_downloaded_copy(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets, "SHAKESPEARE_URL", "http://127.0.0.1:9/input.txt")
    (tmp_path / "sh").mkdir()
    (tmp_path / "sh" / "input.txt").write_text(TEXT)
    meta = prepare_builtin("shakespeare_char", tmp_path / "sh")
    assert meta["n_train"] + meta["n_val"] == len(TEXT)


def test_openwebtext_without_datasets_package_is_a_user_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(UserError, match="pip install datasets"):
        next(hub_stream("HuggingFaceFW/fineweb", "sample-10BT"))


def test_unknown_builtin_dataset_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="stdlib_char"):
        prepare_builtin("wikipedia", tmp_path)


# --------------------------------------------------------------------------------------------- load


def test_load_missing_directory_or_meta(tmp_path):
    with pytest.raises(UserError, match=r"meta\.json not found"):
        load_dataset(tmp_path / "nowhere")


def test_own_shards_without_meta_name_the_missing_meta_and_the_rebuild(prepared):
    (prepared / "meta.json").unlink()
    with pytest.raises(UserError) as err:
        load_dataset(prepared)
    message = str(err.value)
    assert f"{prepared / 'meta.json'} is missing" in message and SHARD in message
    assert f"jaxgpt data --text FILE... --out {prepared} --overwrite" in message and "llm.c" not in message


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda d: (d / "meta.json").write_text("{oops"), "not valid JSON"),
        (lambda d: (d / "meta.json").write_text("[1, 2]"), "JSON object"),
        (lambda d: (d / SHARD).unlink(), f"{SHARD} is missing"),
        (lambda d: (d / SHARD).write_bytes((d / SHARD).read_bytes()[:-2]), "truncated"),
        (lambda d: (d / SHARD).write_bytes(b"\0\0" + (d / SHARD).read_bytes()[2:]), "sha256"),
    ],
)
def test_corrupt_dataset_is_a_user_error(prepared, corrupt, message):
    corrupt(prepared)
    with pytest.raises(UserError, match=message) as err:
        load_dataset(prepared)
    assert "--overwrite" in str(err.value)


@pytest.mark.parametrize(("field", "value"), [("format_version", 99), ("dtype", "uint32"), ("n_val", 0),
                                              ("n_train", "12")])
def test_meta_with_bad_fields_is_a_user_error(prepared, field, value):
    meta = json.loads((prepared / "meta.json").read_text())
    meta[field] = value
    (prepared / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=r"meta\.json"):
        load_dataset(prepared)


def test_verify_false_skips_only_the_hash(prepared):
    (prepared / SHARD).write_bytes(b"\0\0" + (prepared / SHARD).read_bytes()[2:])
    assert load_dataset(prepared, verify=False).train[0] == 0


# ------------------------------------------------------------------------------------------- loader

TOKENS = np.arange(5_000, dtype=np.uint16)  # token value == position, so windows are easy to check


def test_batch_is_a_pure_function_of_seed_and_step():
    kw = {"batch_size": 8, "block_size": 16}
    x1, y1 = batch_for_step(TOKENS, seed=3, step=7, **kw)
    x2, y2 = batch_for_step(TOKENS.copy(), seed=3, step=7, **kw)
    assert np.array_equal(x1, x2) and np.array_equal(y1, y2)
    assert not np.array_equal(x1, batch_for_step(TOKENS, seed=3, step=8, **kw)[0])
    assert not np.array_equal(x1, batch_for_step(TOKENS, seed=4, step=7, **kw)[0])


def test_batch_shapes_and_targets_are_the_next_tokens():
    x, y = batch_for_step(TOKENS, seed=0, step=0, batch_size=8, block_size=16)
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == np.int32
    assert np.array_equal(y, x + 1)
    assert np.array_equal(x, x[:, :1] + np.arange(16))  # each row is one contiguous window


def test_windows_cover_the_whole_token_range():
    starts = np.concatenate([batch_for_step(TOKENS[:20], seed=0, step=s, batch_size=16, block_size=4)[0][:, 0]
                             for s in range(20)])
    assert set(starts.tolist()) == set(range(16))  # every valid start, including the last one


@pytest.mark.parametrize("process_count", [2, 4])
def test_process_slices_concatenate_to_the_global_batch(process_count):
    kw = {"seed": 5, "step": 11, "batch_size": 8, "block_size": 32}
    x, y = batch_for_step(TOKENS, **kw)
    parts = [batch_for_step(TOKENS, process_index=p, process_count=process_count, **kw)
             for p in range(process_count)]
    assert all(px.shape == (8 // process_count, 32) for px, _ in parts)
    assert np.array_equal(np.concatenate([px for px, _ in parts]), x)
    assert np.array_equal(np.concatenate([py for _, py in parts]), y)


def test_loader_reads_a_prepared_memmap(prepared):
    ds = load_dataset(prepared)
    x, y = batch_for_step(ds.train, seed=1, step=2, batch_size=4, block_size=8)
    assert np.array_equal(x[:, 1:], y[:, :-1])
    assert ds.tokenizer.decode(x[0].tolist()) in TEXT


def test_loader_user_errors():
    with pytest.raises(UserError, match="not divisible"):
        batch_for_step(TOKENS, seed=0, step=0, batch_size=6, block_size=8, process_count=4)
    with pytest.raises(UserError, match=r"block size 100 is larger than the validation split \(50 tokens\)"):
        eval_batches(TOKENS[:50], batch_size=2, block_size=100, n_batches=1, seed=0)
    with pytest.raises(UserError, match="larger than the train split"):
        batch_for_step(TOKENS[:50], seed=0, step=0, batch_size=2, block_size=50)
    with pytest.raises(UserError, match="seed -1"):
        batch_for_step(TOKENS, seed=-1, step=0, batch_size=2, block_size=8)


def test_eval_batches_are_fixed_and_separate_from_training():
    kw = {"batch_size": 4, "block_size": 16, "n_batches": 3, "seed": 9}
    first, second = eval_batches(TOKENS, **kw), eval_batches(TOKENS, **kw)
    assert len(first) == 3
    for (x1, y1), (x2, y2) in zip(first, second, strict=True):
        assert np.array_equal(x1, x2) and np.array_equal(y1, y2)
    train_x = batch_for_step(TOKENS, seed=9, step=0, batch_size=4, block_size=16)[0]
    assert not np.array_equal(first[0][0], train_x)
    halves = [eval_batches(TOKENS, process_index=p, process_count=2, **kw) for p in range(2)]
    assert np.array_equal(np.concatenate([halves[0][1][0], halves[1][1][0]]), first[1][0])


def test_filler_rows_complete_the_last_batch_and_count_nothing():
    data = {"x": np.arange(10).reshape(5, 2), "weight": np.ones(5, np.float32), "mask": np.ones((5, 3), np.int32)}
    batches = filler_batches(data, np.array([4, 0, 2]), 2, ("weight", "mask"))
    assert [b["x"][:, 0].tolist() for b in batches] == [[8, 0], [4, 4]]  # the last row repeated, one shape
    assert [b["weight"].tolist() for b in batches] == [[1, 1], [1, 0]]
    assert batches[1]["mask"].tolist() == [[1, 1, 1], [0, 0, 0]] and batches[1]["mask"].dtype == np.int32
    halves = [filler_batches(data, np.array([4, 0, 2]), 2, ("weight",), slice(p, p + 1)) for p in range(2)]
    assert [h[1]["weight"].tolist() for h in halves] == [[1], [0]]  # each process its share of every batch


def test_random_stream_ids_are_one_table_of_distinct_non_zero_numbers():
    ids = {name: value for name, value in vars(streams).items() if name.endswith("_STREAM")}
    assert all(isinstance(v, int) and v > 0 for v in ids.values()), ids
    assert len(set(ids.values())) == len(ids), f"two streams share an id: {sorted(ids.items(), key=lambda x: x[1])}"
    table = Path(streams.__file__)
    elsewhere = [f"{path.name}: {line}" for path in sorted(table.parents[1].rglob("*.py")) if path != table
                 for line in path.read_text().splitlines() if re.match(r"\w+_STREAM\b.*=", line)]
    assert not elsewhere, f"stream ids defined outside jaxgpt/data/streams.py: {elsewhere}"


# ---------------------------------------------------------------------------------------------- CLI


def test_cli_prepares_text_and_prints_one_line(tmp_path, capsys):
    (tmp_path / "a.txt").write_text(TEXT)
    assert data_command.main(["jaxgpt data", "--text", str(tmp_path / "a.txt"), "--out", str(tmp_path / "ds")]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and f"vocab {len(VOCAB)}" in out
    assert load_dataset(tmp_path / "ds").meta["n_val"] == int(len(TEXT) * 0.1)


def test_cli_text_takes_several_files_in_order(tmp_path, capsys):
    """`--text a.txt b.txt` (as before the commands layer) and `--text a.txt --text b.txt` are the same."""
    (tmp_path / "a.txt").write_text(TEXT)
    (tmp_path / "b.txt").write_text(TEXT.upper())
    files = [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]
    assert data_command.main(["jaxgpt data", "--text", *files, "--out", str(tmp_path / "one")]) == 0
    assert data_command.main(["jaxgpt data", "--text", files[0], "--out", str(tmp_path / "two"), "--text",
                              files[1]]) == 0
    assert _bin_bytes(tmp_path / "one") == _bin_bytes(tmp_path / "two")
    ds = load_dataset(tmp_path / "one")
    assert ds.meta["n_train"] + ds.meta["n_val"] == 2 * len(TEXT)
    assert ds.tokenizer.decode(ds.val.tolist()) == (TEXT + TEXT.upper())[-ds.meta["n_val"]:]
    capsys.readouterr()
    assert data_command.main(["jaxgpt data", "--dataset", "stdlib_char", "--out", str(tmp_path / "x"), files[0]]) == 2
    assert "unexpected arguments" in capsys.readouterr().err


def test_cli_user_error_exits_2_with_one_line(tmp_path, capsys):
    code = data_command.main(["jaxgpt data", "--text", str(tmp_path / "absent.txt"), "--out", str(tmp_path / "ds")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1


def test_cli_gpt2_offline_without_ranks_is_a_user_error(tmp_path, capsys, monkeypatch):
    """No ranks file and tiktoken's downloads refused at once (a proxy on a closed port)."""
    monkeypatch.delenv(tok.BPE_FILE_ENV, raising=False)
    monkeypatch.setattr(tok, "DEFAULT_BPE_FILE", tmp_path / "absent.tiktoken")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-cache"))
    for var in ("HTTPS_PROXY", "https_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    for var in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
    (tmp_path / "a.txt").write_text(TEXT)
    argv = ["--text", str(tmp_path / "a.txt"), "--tokenizer", "gpt2", "--out", str(tmp_path / "ds")]
    code = data_command.main(["jaxgpt data", *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: no GPT-2 BPE ranks") and err.count("\n") == 1
