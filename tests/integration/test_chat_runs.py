"""Chat SFT on the training loop: it trains, saves the template and resumes bit-exact (packed or not), refuses
bad settings in one line, cuts JSONL conversations to the context and scores the held-out ones (moved from
tests/unit/tasks/test_chat.py: they build or train the task from a saved base run)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import logged_records
from helpers.chat import ALPHABET, render, sft_config
from helpers.models import save_random_lm

from jaxgpt.data.conversations import (
    CHAT_TEMPLATE,
    END,
    TEMPLATE_FILE,
    encode_conversation,
    split_held_out,
    to_rows,
)
from jaxgpt.data.tokenizer import CharTokenizer
from jaxgpt.errors import UserError
from jaxgpt.io import weights
from jaxgpt.model.config import ModelConfig
from jaxgpt.tasks.chat import held_out_conversations
from jaxgpt.train.config import from_config_dict


@pytest.fixture(scope="module")
def base_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    workdir = tmp_path_factory.mktemp("base")  # 96 positions: room for a count question and its counting aloud
    cfg = ModelConfig(vocab_size=len(ALPHABET), block_size=96, n_layer=2, n_head=2, n_embd=32)
    save_random_lm(workdir, cfg, CharTokenizer(ALPHABET))
    return workdir


@pytest.mark.parametrize("pack", [False, True])
def test_sft_trains_saves_the_template_and_resumes_bit_exact(tmp_path: Path, base_run: Path, pack: bool) -> None:
    from helpers import train_run

    whole_dir, split_dir = tmp_path / "whole", tmp_path / "split"
    whole = train_run(sft_config(whole_dir, base_run, **{"chat.pack": pack}))
    evals = logged_records(whole_dir)
    val_losses = [row["val_loss"] for row in evals if "val_loss" in row]
    assert len(val_losses) == 2 and val_losses[1] < val_losses[0]
    assert 0 <= whole["val_exact_match"] <= 1 and set(whole["val_exact_match_by_dataset"]) == {
        "arithmetic", "reverse", "count", "fact"}
    assert (whole_dir / TEMPLATE_FILE).read_text() == CHAT_TEMPLATE
    loaded = weights.load(f"workdir:{whole_dir}")
    tok = loaded.tokenizer()
    assert loaded.model.vocab_size == len(ALPHABET) + 4 == tok.vocab_size
    assert tok.encode(render([{"role": "user", "content": "hi"}], True))[-1] == tok.special_ids["<|assistant|>"]
    assert loaded.meta["chat"]["end_id"] == tok.special_ids[END]
    shutil.copytree(whole_dir, split_dir)  # the run as it was when it stopped after step 6
    shutil.rmtree(split_dir / "checkpoints" / "12")
    resumed = train_run(sft_config(split_dir, base_run, **{"chat.pack": pack}))
    assert resumed["steps"] == 6 and resumed["val_loss"] == whole["val_loss"]
    for a, b in zip(jax.tree.leaves(whole["state"]["params"]), jax.tree.leaves(resumed["state"]["params"]),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(("overrides", "message"), [
    ({"init_from": ""}, "init_from is empty"),
    ({"chat.data": "chat.txt"}, "neither 'builtin' nor a .jsonl"),
    ({"chat.data": "hf:HuggingFaceTB/smoltalk"}, "to_json"),
    ({"chat.datasets": "arithmetic,poetry"}, "unknown built-in dataset"),
    ({"chat.tasks": "arithmetic,poetry"}, "unknown built-in dataset"),  # the key's old name
    ({"model.block_size": 8}, "no conversation's first assistant turn fits"),
    ({"chat.pack": True, "model.attention_impl": "splash"}, "splash sees padding, not documents"),
])
def test_bad_chat_config_is_a_user_error(tmp_path: Path, base_run: Path, overrides: dict, message: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from jaxgpt.tasks import build

    for module in ("datasets.config", "huggingface_hub.constants"):  # offline at once, not after the Hub's retries
        if importlib.util.find_spec(module.split(".")[0]):
            monkeypatch.setattr(importlib.import_module(module), "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError, match=message):
        build(from_config_dict(sft_config(tmp_path / "w", base_run, **overrides)))


def test_a_jsonl_file_is_cut_to_the_context_with_counts_and_unknown_text_names_its_line(tmp_path: Path,
                                                                                          base_run: Path) -> None:
    from jaxgpt.tasks import build

    turn = lambda role, text: {"role": role, "content": text}
    short = [turn("user", "What is 1 + 1?"), turn("assistant", "2")]
    long = [*short, turn("user", "Spell 'apple' backwards. " * 4), turn("assistant", "elppa")]
    too_long = [turn("user", "a" * 100), turn("assistant", "b")]
    lines = [json.dumps({"messages": m}) for m in [short] * 30 + [long] * 10 + [too_long] * 5]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(lines) + "\n")
    task = build(from_config_dict(sft_config(tmp_path / "w", base_run, **{"chat.data": str(path),
                                                                           "chat.val_fraction": 0.4})))
    assert "10 cut at a turn boundary and 5 dropped" in task.describe()
    # rows as wide as the longest kept conversation, less one: <|user|> 14 characters <|end|> <|assistant|> 2 <|end|>
    assert task.width == 18 and task.meta["chat"]["n_train"] + task.meta["chat"]["n_val"] == 40
    path.write_text("\n".join([lines[0], json.dumps({"messages": [turn("user", "café?"), turn("assistant", "x")]})]))
    with pytest.raises(UserError, match=f"^{path}:2: text has characters outside"):
        build(from_config_dict(sft_config(tmp_path / "w", base_run, **{"chat.data": str(path)})))


def test_held_out_conversations_are_the_ones_the_trainer_scores_when_some_are_dropped_or_cut(
        tmp_path: Path, base_run: Path) -> None:
    """What benchmarks/bench_chat.py asks the server (`held_out_conversations`) is the trainer's held-out rows,
    one for one: conversations too long for the context are dropped before the split, not held out, and a
    conversation cut to the context ends at its last assistant turn that fits."""
    from jaxgpt.tasks import build

    turn = lambda role, text: {"role": role, "content": text}
    short = [[turn("user", f"What is {i} + 1?"), turn("assistant", str(i + 1))] for i in range(40)]
    long = [[turn("user", f"What is {i} + 2?"), turn("assistant", str(i + 2)),
             turn("user", "Spell 'apple' backwards. " * 4), turn("assistant", "elppa")] for i in range(20)]
    too_long = [[turn("user", f"{i} {'a' * 100}"), turn("assistant", "b")] for i in range(20)]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in short + long + too_long))
    cfg = from_config_dict(sft_config(tmp_path / "w", base_run, **{"chat.data": str(path),
                                                                    "chat.val_fraction": 0.4}))
    task = build(cfg)
    assert "20 cut at a turn boundary and 20 dropped" in task.describe()
    assert any(m in too_long for m in split_held_out(short + long + too_long, 0.4)[1])  # some held out, were they kept

    held = held_out_conversations(cfg.chat, cfg.seed, task.tokenizer, task.model_cfg.block_size)
    assert len(held) == task.meta["chat"]["n_val"] and {kind for _, kind in held} == {"conversations"}
    assert any(m == c[:2] for m, _ in held for c in long)  # a cut conversation, up to the turn that fits
    rows = to_rows([encode_conversation(task.tokenizer, m) for m, _ in held], task.width)
    for key, value in task.data["val"].items():
        np.testing.assert_array_equal(value, rows[key], err_msg=key)
