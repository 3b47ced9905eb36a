"""The seq2seq task: pair files, model ids, batches, the masked and smoothed loss, Noam (the task on the loop and
its weights: tests/integration/test_seq2seq_run.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.seq2seq import task_config

from jaxgpt.data import pairs
from jaxgpt.data.tokenizer import CharTokenizer
from jaxgpt.errors import UserError
from jaxgpt.model.config import ModelConfig, Seq2SeqConfig
from jaxgpt.model.encdec import abstract_variables
from jaxgpt.ops.loss import token_cross_entropy
from jaxgpt.tasks.seq2seq import Seq2Seq, seq2seq_loss
from jaxgpt.train.config import from_config_dict
from jaxgpt.train.flops import seq2seq_flops_per_token
from jaxgpt.train.optim import OptimConfig, noam, schedule

# ----------------------------------------------------------------------------------------------------
# Pair files


def test_tsv_reads_two_and_tatoeba_three_columns_and_skips_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "fra.txt"
    path.write_text("Go.\tVa !\tCC-BY 2.0 (France) Attribution: tatoeba.org #2877272 (CM)\n\n"
                    "Hi.\tSalut !\n", encoding="utf-8")
    assert pairs.read_pairs(path) == [("Go.", "Va !"), ("Hi.", "Salut !")]


def test_jsonl_reads_source_and_target(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"source": "a b", "target": "b a", "id": 3}) + "\n\n"
                    + json.dumps({"source": "é", "target": "É"}) + "\n", encoding="utf-8")
    assert pairs.read_pairs(path) == [("a b", "b a"), ("é", "É")]


@pytest.mark.parametrize("name, text, problem", [
    ("p.tsv", "a\tb\nno tab here\n", "found no tab"),
    ("p.tsv", "a\tb\nc\t \n", "the target is empty"),
    ("p.jsonl", '{"source": "a", "target": "b"}\n{"source": "a"\n', "not valid JSON"),
    ("p.jsonl", '{"source": "a", "target": "b"}\n{"source": "a", "target": 3}\n', '"source" and "target"'),
])
def test_malformed_line_is_one_line_error_naming_file_and_line(tmp_path: Path, name: str, text: str,
                                                              problem: str) -> None:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    with pytest.raises(UserError, match=problem) as e:
        pairs.read_pairs(path)
    assert f"{path}:2:" in str(e.value) and "\n" not in str(e.value)


def test_missing_file_and_missing_path_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not found"):
        pairs.read_pairs(tmp_path / "nope.tsv")
    with pytest.raises(UserError, match="data is empty"):
        pairs.load_pairs("", 0.1, 10, 10, 10)


# ----------------------------------------------------------------------------------------------------
# Model ids, built-in data, batches


def test_text_ids_sit_after_the_specials_and_decoding_stops_at_eos() -> None:
    tok = CharTokenizer("abc")
    ids = pairs.encode_text(tok, pairs.SPECIALS, "cab")
    assert ids == [5, 3, 4]
    bos, eos, pad = (pairs.SPECIALS[k] for k in ("bos_id", "eos_id", "pad_id"))
    assert pairs.decode_ids(tok, pairs.SPECIALS, [bos, *ids, eos, 3, pad]) == "cab"
    assert pairs.decode_ids(tok, pairs.SPECIALS, [*ids, pad, pad]) == "cab"


def test_synthetic_and_stdlib_targets_follow_their_rule() -> None:
    for source, target in pairs.synthetic_pairs("reverse", 50, 7, 9):
        assert target == source[::-1] and 1 <= len(source) <= 9 and set(source) <= set(pairs.SYMBOLS[:7])
    assert all(s == t for s, t in pairs.synthetic_pairs("copy", 20, 5, 4))
    assert pairs.reverse_words("get_default_value") == "value_default_get"


def test_split_is_by_source_and_the_same_every_time() -> None:
    data = [(f"s{i % 40}", f"t{i}") for i in range(400)]
    train, val = pairs.split(data, 0.2)
    assert pairs.split(data, 0.2) == (train, val)
    assert not {s for s, _ in train} & {s for s, _ in val} and len(train) + len(val) == 400


def test_batches_are_a_pure_function_of_seed_and_step_with_shifted_targets(tmp_path: Path) -> None:
    cfg = from_config_dict(task_config(tmp_path))
    a, b = Seq2Seq(cfg), Seq2Seq(cfg)
    for step in (0, 7, 500):
        x, y = a.train_rows(step, 0, 1), b.train_rows(step, 0, 1)
        assert all(np.array_equal(x[k], y[k]) for k in x)
        halves = [a.train_rows(step, p, 2) for p in (0, 1)]  # two processes read the two halves
        assert all(np.array_equal(np.concatenate([h[k] for h in halves]), x[k]) for k in x)
    assert not np.array_equal(a.train_rows(0, 0, 1)["src"], a.train_rows(1, 0, 1)["src"])
    r, pad = a.train_rows(3, 0, 1), pairs.SPECIALS["pad_id"]
    assert (r["tgt_in"][:, 0] == pairs.SPECIALS["bos_id"]).all()
    text = r["tgt_out"][:, :-1] >= pairs.SPECIALS["offset"]
    assert np.array_equal(r["tgt_in"][:, 1:][text], r["tgt_out"][:, :-1][text])  # shifted by one
    assert ((r["tgt_in"] != pad).sum(1) == (r["tgt_out"] != pad).sum(1)).all()
    assert ((r["tgt_out"] == pairs.SPECIALS["eos_id"]).sum(1) == 1).all()
    for (s, t), src in zip(a.val_pairs[:5], a.data["val"]["src"][:5], strict=True):  # sources: ids, no bos/eos
        assert pairs.decode_ids(a.tokenizer, pairs.SPECIALS, src) == s and t == s[::-1]


# ----------------------------------------------------------------------------------------------------
# Loss and schedule


def test_padding_and_filler_rows_do_not_change_the_loss() -> None:
    rng = np.random.default_rng(0)
    tgt_out = np.array([[5, 6, 2, 0, 0], [7, 2, 0, 0, 0], [4, 4, 4, 4, 2]], np.int32)
    batch = {"tgt_out": jnp.asarray(tgt_out), "weight": jnp.array([1.0, 1.0, 0.0])}
    logits = rng.normal(size=(3, 5, 9)).astype(np.float32)
    base = seq2seq_loss(jnp.asarray(logits), batch, 0.1)
    changed = logits.copy()
    changed[tgt_out == 0] = rng.normal(size=((tgt_out == 0).sum(), 9)) * 10  # pad positions
    changed[2] = rng.normal(size=(5, 9))  # the filler row
    assert float(seq2seq_loss(jnp.asarray(changed), batch, 0.1)) == pytest.approx(float(base), rel=1e-6)
    real = (tgt_out != 0) & (np.array([1, 1, 0])[:, None] == 1)
    expect = np.asarray(token_cross_entropy(jnp.asarray(logits), jnp.asarray(tgt_out), 0.1))[real].mean()
    assert float(base) == pytest.approx(float(expect), rel=1e-6)


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.3])
def test_label_smoothing_is_optax_smoothed_cross_entropy(smoothing: float) -> None:
    logits = jax.random.normal(jax.random.key(1), (2, 4, 11)) * 3
    labels = jax.random.randint(jax.random.key(2), (2, 4), 0, 11)
    want = optax.softmax_cross_entropy(logits, optax.smooth_labels(jax.nn.one_hot(labels, 11), smoothing))
    np.testing.assert_allclose(token_cross_entropy(logits, labels, smoothing), want, rtol=1e-5)
    if not smoothing:
        np.testing.assert_allclose(token_cross_entropy(logits, labels, 0.0),
                                   optax.softmax_cross_entropy_with_integer_labels(logits, labels), rtol=1e-6)


def test_noam_peaks_at_warmup_and_scales_by_inverse_sqrt_width() -> None:
    rate = noam(2.0, 512, 400)
    values = np.array([float(rate(i)) for i in range(2000)])
    assert values.argmax() == 399  # update n = count + 1 = warmup
    assert values[399] == pytest.approx(2.0 * (512 * 400) ** -0.5, rel=1e-5)
    assert values[0] == pytest.approx(2.0 * 512**-0.5 * 400**-1.5, rel=1e-5)  # step 0 is a real update
    assert values[1599] == pytest.approx(values[399] / 2, rel=1e-5)  # 1 / sqrt(n) after the warmup
    wide, narrow = schedule(OptimConfig(schedule="noam", warmup_steps=400), 2048), schedule(
        OptimConfig(schedule="noam", warmup_steps=400), 512)
    assert float(narrow(50)) == pytest.approx(2 * float(wide(50)), rel=1e-6)
    with pytest.raises(UserError, match="schedule"):
        OptimConfig(schedule="linear")


def test_flops_count_every_weight_use_of_a_row() -> None:
    """6 x (each kernel's size x the tokens it multiplies) plus attention, per source + target token."""
    cfg = Seq2SeqConfig(ModelConfig(vocab_size=23, block_size=9, n_layer=2, n_head=2, n_embd=16, pad_id=0),
                        n_encoder_layer=2, src_block_size=12)
    params = nn.unbox(abstract_variables(cfg)["params"])  # shapes only: nothing is computed
    S, T = cfg.src_block_size, cfg.model.block_size
    uses = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        names = [p.key for p in path]
        if names[-1] != "kernel" and names[0] != "wte":
            continue
        per_source = names[0].startswith("enc_") or (names[1:3] == ["cross", "kv"])
        uses += math.prod(leaf.shape) * (S if per_source else T)
    HD = cfg.model.n_head * cfg.model.head_dim
    attention = 3 * 4 * HD * (2 * S * S + cfg.model.n_layer * (T * T / 2 + T * S))
    assert seq2seq_flops_per_token(cfg) == pytest.approx((6 * uses + attention) / (S + T))
