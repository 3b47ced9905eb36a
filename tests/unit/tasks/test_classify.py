"""Classification fine-tuning: data parsing and label maps, the loss, batches, a tiny end-to-end run, bad input."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ROOT, logged_records
from helpers.models import save_random_lm

from jaxgpt.data import classify_data
from jaxgpt.data.batches import batch_indices
from jaxgpt.data.tokenizer import CharTokenizer
from jaxgpt.errors import UserError
from jaxgpt.io.checkpoint import Checkpointer
from jaxgpt.model.config import ModelConfig
from jaxgpt.model.gpt import GPTClassifier, init_params
from jaxgpt.tasks import classify
from jaxgpt.train.config import base_config, from_config_dict

ALPHABET = "\nabcdefxyz"  # sorted by code point, as CharTokenizer requires


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# ----------------------------------------------------------------------------------------------------
# Reading data


def test_csv_labels_strings_map_sorted_and_quoted_fields_survive(tmp_path: Path) -> None:
    path = write(tmp_path / "d.csv", '\ufeffid,text,label\n1,"a, b",spam\n2,"two\nlines",ham\n3,c,spam\n')
    ex = classify_data.read_labelled(path)
    assert ex.texts == ["a, b", "two\nlines", "c"] and ex.labels == ["spam", "ham", "spam"]
    names = classify_data.label_names(ex.labels)
    assert names == ["ham", "spam"]
    assert classify_data.label_ids(ex.labels, names).tolist() == [1, 0, 1]


def test_csv_integer_labels_become_ints_sorted_numerically(tmp_path: Path) -> None:
    ex = classify_data.read_labelled(write(tmp_path / "d.csv", "text,label\na,10\nb,2\nc,-1\n"))
    assert ex.labels == [10, 2, -1]
    assert classify_data.label_names(ex.labels) == [-1, 2, 10]


def test_jsonl_int_and_string_labels(tmp_path: Path) -> None:
    ints = write(tmp_path / "i.jsonl", '{"text": "x", "label": 1}\n\n{"text": "y", "label": 0, "extra": 3}\n')
    ex = classify_data.read_labelled(ints)
    assert ex.texts == ["x", "y"] and ex.labels == [1, 0] and classify_data.label_names(ex.labels) == [0, 1]
    strs = write(tmp_path / "s.jsonl", "\n".join(json.dumps({"text": t, "label": lab})
                                                 for t, lab in [("a", "pos"), ("b", "neg")]))
    assert classify_data.label_names(classify_data.read_labelled(strs).labels) == ["neg", "pos"]


@pytest.mark.parametrize("name,content,message", [
    ("empty.csv", "", "is empty"),
    ("header.csv", "text,label\n", "no rows"),
    ("cols.csv", "sentence,label\nhi,a\n", "lacks ['text']"),
    ("short.csv", "text,label\nhi\n", "fewer fields"),
    ("blank.csv", "text,label\nhi,\n", "label '' must be"),
    ("empty.jsonl", "\n\n", "is empty"),
    ("bad.jsonl", '{"text": "a", "label": 1}\n{oops\n', "bad.jsonl:2: not valid JSON"),
    ("keys.jsonl", '{"text": "a"}\n', "keys `text` and `label`"),
    ("float.jsonl", '{"text": "a", "label": 1.5}\n', "must be a non-empty string or an integer"),
    ("data.txt", "whatever", "neither a built-in dataset"),
])
def test_bad_files_are_one_line_user_errors(tmp_path: Path, name: str, content: str, message: str) -> None:
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
        classify_data.read_labelled(write(tmp_path / name, content))


def test_missing_file_single_class_and_mixed_labels(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not found"):
        classify_data.read_labelled(tmp_path / "nope.csv")
    with pytest.raises(UserError, match="single class"):
        classify_data.label_names(["a", "a"])
    with pytest.raises(UserError, match="mixes integer and string"):
        classify_data.label_names([1, "1"])


def test_stratified_split_holds_out_each_class() -> None:
    ids = np.array([0] * 50 + [1] * 10 + [2] * 1)
    train, val = classify_data.stratified_split(ids, 0.2, seed=3)
    assert sorted(np.concatenate([train, val]).tolist()) == list(range(len(ids)))
    assert np.bincount(ids[val], minlength=3).tolist() == [10, 2, 0]  # a singleton class stays in training
    again = classify_data.stratified_split(ids, 0.2, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip((train, val), again, strict=True))


def test_builtin_task_is_balanced_deterministic_and_file_disjoint() -> None:
    train, val, description = classify_data.stdlib_packages_task(0.2, per_class=200)
    assert "stdlib_packages" in description
    for ex in (train, val):
        counts = {label: ex.labels.count(label) for label in classify_data.STDLIB_PACKAGES}
        assert len(set(counts.values())) == 1, counts
        assert all(len(t) == classify_data.SNIPPET_CHARS for t in ex.texts)
    assert len(val) == 4 * 40 and not set(train.texts) & set(val.texts)
    assert classify_data.stdlib_packages_task(0.2, per_class=200)[1].texts == val.texts


# ----------------------------------------------------------------------------------------------------
# Encoding, batches, loss


def test_rows_are_truncated_then_left_padded_with_the_cls_token_last() -> None:
    tok = CharTokenizer(ALPHABET)
    cls_id = classify_data.cls_token_id(tok)
    assert tok.decode([cls_id]) == "\n"
    x, mask = classify_data.encode_texts(["ab", "abcdefxyz", ""], tok, cls_id, width=5)
    assert x[:, -1].tolist() == [cls_id] * 3
    assert mask.tolist() == [[False, False, True, True, True], [True] * 5, [False] * 4 + [True]]
    assert tok.decode(x[1, :-1].tolist()) == "abcd"
    assert tok.decode(x[0, 2:].tolist()) == "ab\n"
    with pytest.raises(UserError, match=re.escape("example 1 ('ab!')")):
        classify_data.encode_texts(["ab", "ab!"], tok, cls_id, width=5)
    with pytest.raises(UserError, match="not a single token"):
        classify_data.cls_token_id(tok, "ab")


def test_batches_are_a_pure_function_of_seed_and_step_and_cover_each_epoch() -> None:
    n, b = 10, 4
    first = [batch_indices(7, s, n, b) for s in range(5)]
    assert all(np.array_equal(a, batch_indices(7, s, n, b)) for s, a in enumerate(first))
    flat = np.concatenate(first)  # 20 positions = two epochs
    assert sorted(flat[:10].tolist()) == list(range(10)) and sorted(flat[10:].tolist()) == list(range(10))
    assert not np.array_equal(flat[:10], flat[10:])


def test_loss_is_class_cross_entropy_plus_weighted_lm_loss() -> None:
    rng = np.random.default_rng(0)
    B, T, V, K = 3, 6, 11, 4
    lm = rng.normal(size=(B, T, V)).astype(np.float32)
    cls = rng.normal(size=(B, K)).astype(np.float32)
    x = rng.integers(0, V, size=(B, T)).astype(np.int32)
    mask = np.ones((B, T), bool)
    mask[0, :2] = False  # left padding
    mask[2, :5] = False  # only the class token is real: no language-model target at all
    batch = {"x": x, "mask": mask, "label": np.array([3, 0, 1], np.int32), "weight": np.array([1, 1, 0], np.float32)}

    def log_softmax(z: np.ndarray) -> np.ndarray:
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    cls_ce = [-log_softmax(cls[i])[batch["label"][i]] for i in (0, 1)]  # row 2 has weight 0
    # Real text tokens t whose successor t+1 is also text (not the class token in column T-1).
    lm_ce = [-log_softmax(lm[i, t])[x[i, t + 1]] for i in (0, 1) for t in range(T - 2) if mask[i, t]]
    for lm_weight in (0.0, 0.5):
        loss, parts = classify.classification_loss(jnp.asarray(lm), jnp.asarray(cls), batch, lm_weight)
        np.testing.assert_allclose(parts["cls_loss"], np.mean(cls_ce), rtol=1e-5)
        np.testing.assert_allclose(parts["lm_loss"], np.mean(lm_ce), rtol=1e-5)
        np.testing.assert_allclose(loss, np.mean(cls_ce) + lm_weight * np.mean(lm_ce), rtol=1e-5)


# ----------------------------------------------------------------------------------------------------
# End to end


def synthetic_csv(path: Path, n: int, seed: int) -> Path:
    """An easy 3-class task: the letters a text is drawn from (abc / def / xyz), labels as strings."""
    rng = np.random.default_rng(seed)
    groups = {"low": "abc", "mid": "def", "high": "xyz"}
    names = list(groups)
    lines = ["text,label"]
    for i in range(n):
        label = names[i % 3] if i % 5 else "low"  # "low" is the majority class
        lines.append("".join(rng.choice(list(groups[label]), size=rng.integers(4, 14))) + f",{label}")
    return write(path, "\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    workdir = tmp_path_factory.mktemp("lm")
    cfg = ModelConfig(vocab_size=len(ALPHABET), block_size=24, n_layer=2, n_head=2, n_embd=32)
    save_random_lm(workdir, cfg, CharTokenizer(ALPHABET))
    return workdir


def tiny_config(workdir: Path, lm: Path, data: Path, **overrides: object):
    c = base_config()
    c.task, c.workdir, c.init_from, c.classify.data = "classify", str(workdir), f"workdir:{lm}", str(data)
    c.batch_size, c.max_steps, c.eval_interval, c.log_interval = 16, 40, 20, 10
    c.optim.lr, c.optim.warmup_steps = 3e-3, 5
    c.compilation_cache_dir = ""
    for key, value in overrides.items():
        if key in c.classify:
            c.classify[key] = value
        else:
            c[key] = value
    return c


def finetune(c) -> dict:
    from helpers import train_run

    return train_run(c)


def test_finetune_beats_majority_saves_and_predicts(tmp_path: Path, tiny_lm: Path) -> None:
    data = synthetic_csv(tmp_path / "easy.csv", 300, seed=0)
    workdir = tmp_path / "cls"
    result = finetune(tiny_config(workdir, tiny_lm, data))
    val = result["val"]
    assert result["labels"] == ["high", "low", "mid"]
    assert val["accuracy"] > result["majority_baseline"] + 0.3, (val, result["majority_baseline"])

    rows = logged_records(workdir)
    evals = [r for r in rows if "val_accuracy" in r]
    assert [r["step"] for r in evals] == [20, 40] and evals[-1]["val_accuracy"] == val["accuracy"]

    texts = ["abcab", "xyzzy", "fed", "ccc"]
    assert classify.predict(workdir, texts) == ["low", "high", "mid", "low"]
    meta = Checkpointer(workdir, read_only=True).read_meta(40)
    assert meta["classifier"]["labels"] == ["high", "low", "mid"] and meta["classifier"]["n_class"] == 3
    assert meta["classifier"]["cls_token_id"] == ALPHABET.index("\n") and meta["tokenizer"]["type"] == "char"

    again = finetune(tiny_config(workdir, tiny_lm, data))  # resumes at the end: nothing to do
    assert again["steps"] == 0
    with pytest.raises(UserError, match="holds a run with other max_len: "):
        finetune(tiny_config(workdir, tiny_lm, synthetic_csv(tmp_path / "two.csv", 40, 1), max_len=8))


@pytest.mark.slow
def test_finetune_from_a_gpt2_directory_uses_the_end_of_text_token(tmp_path: Path) -> None:
    """hf:PATH with GPT-2's BPE: a tiny random GPT-2 written by jaxgpt's exporter; rows end with eot 50256."""
    from jaxgpt.data.tokenizer import GPT2_EOT, load_bpe
    from jaxgpt.io.hf import save_hf

    try:
        load_bpe("gpt2")
    except UserError:
        pytest.skip("GPT-2 BPE ranks unavailable: run .ci/provision_bpe.sh")
    cfg = ModelConfig(vocab_size=50257, block_size=32, n_layer=1, n_head=2, n_embd=16)
    hf_dir = save_hf(init_params(cfg, jax.random.key(0)), cfg, tmp_path / "gpt2")
    jsonl = write(tmp_path / "d.jsonl", "".join(json.dumps({"text": f"{word} number {i}", "label": int(word == "cat")})
                                                + "\n" for i in range(40) for word in ("cat", "dog")))
    workdir = tmp_path / "cls"
    result = finetune(tiny_config(workdir, tmp_path, jsonl, init_from=f"hf:{hf_dir}", max_len=12,
                                           max_steps=20, eval_interval=20))
    assert result["labels"] == [0, 1]
    clf = classify.load_classifier(workdir)
    assert clf.model.cls_token_id == GPT2_EOT and clf.width == 4 and clf.model.cfg.block_size == 12
    assert set(clf.predict(["cat number 3", "dog", "a text longer than the twelve tokens of max_len ..."])) <= {0, 1}


def test_classifier_reads_the_last_column() -> None:
    """With the class token last, the class logits come from the final position's hidden state."""
    cfg = ModelConfig(vocab_size=len(ALPHABET), block_size=8, n_layer=1, n_head=2, n_embd=16)
    model = GPTClassifier(cfg, n_class=2, cls_token_id=ALPHABET.index("\n"), cls_dropout=0.0)
    params = init_params(cfg, jax.random.key(1), model)
    x, mask = classify_data.encode_texts(["a\nb", "xyz"], CharTokenizer(ALPHABET), model.cls_token_id, 6)
    _, cls = jax.jit(model.apply)({"params": params}, x, mask)
    h = jax.jit(lambda p, x, m: model.apply(p, x, m, method=GPTClassifier.hidden))({"params": params}, x, mask)[:, -1]
    want = h @ params["cls_head"]["kernel"] + params["cls_head"]["bias"]
    np.testing.assert_allclose(cls, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("overrides,message", [
    (dict(init_from="workdir:/nonexistent/lm"), "does not exist"),
    (dict(init_from="somewhere"), "not understood"),
    (dict(init_from=""), "init_from is empty"),
    (dict(val_fraction=1.0), "val_fraction"),
    (dict(max_len=99), "exceeds the model's block_size"),
])
def test_bad_config_is_a_user_error(tmp_path: Path, tiny_lm: Path, overrides: dict, message: str) -> None:
    data = synthetic_csv(tmp_path / "easy.csv", 30, seed=0)
    with pytest.raises(UserError, match=message):
        finetune(tiny_config(tmp_path / "w", tiny_lm, data, **overrides))


def test_single_class_data_is_a_user_error(tmp_path: Path, tiny_lm: Path) -> None:
    data = write(tmp_path / "one.jsonl", '{"text": "ab", "label": "a"}\n{"text": "cd", "label": "a"}\n')
    with pytest.raises(UserError, match="single class"):
        finetune(tiny_config(tmp_path / "w", tiny_lm, data))


def test_cli_prints_one_line_error_and_exits_2(tmp_path: Path) -> None:
    config = str(ROOT / "configs" / "classify_stdlib.py")
    proc = subprocess.run([sys.executable, "train.py", "--config", config,
                           f"--config.workdir={tmp_path / 'w'}", "--config.init_from=workdir:/nonexistent/lm"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: ") and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.slow
def test_builtin_task_runs_from_a_char_model_and_a_classifier_refines(tmp_path: Path) -> None:
    """The built-in dataset end to end (random weights, so only the plumbing is checked), then a second
    fine-tune that starts from the first classifier (its body, without the head)."""
    train, val, _ = classify_data.stdlib_packages_task(0.2)
    tok = CharTokenizer.from_text("".join(train.texts + val.texts) + "\n")
    lm = tmp_path / "lm"
    save_random_lm(lm, ModelConfig(vocab_size=tok.vocab_size, block_size=160, n_layer=1, n_head=2, n_embd=32), tok)
    first = finetune(tiny_config(tmp_path / "a", lm, "stdlib_packages", max_steps=10, eval_interval=10))
    assert first["labels"] == list(classify_data.STDLIB_PACKAGES) and first["majority_baseline"] == 0.25
    data = synthetic_csv(tmp_path / "easy.csv", 60, seed=2)
    snowmen = write(tmp_path / "snow.csv", "text,label\n" + "".join(f"a\u2603,{i % 2}\n" for i in range(10)))
    with pytest.raises(UserError, match=re.escape("example 0 ('a\u2603'): text has characters outside")):
        finetune(tiny_config(tmp_path / "b", tmp_path / "a", snowmen))
    second = finetune(tiny_config(tmp_path / "b", tmp_path / "a", data, max_steps=10, eval_interval=10))
    assert second["labels"] == ["high", "low", "mid"]


def test_shipped_config_is_valid() -> None:
    """configs/classify_stdlib.py loads and passes the checks (tests/unit/test_configs.py covers the LM configs)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("classify_stdlib", ROOT / "configs" / "classify_stdlib.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    cfg = from_config_dict(c)
    assert cfg.task == "classify" and c.classify.data in classify_data.BUILTIN_DATASETS
    assert c.init_from.startswith("workdir:")
    assert cfg.optim.decay_steps == c.max_steps and c.max_steps % c.eval_interval == 0
