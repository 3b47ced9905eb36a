"""LoRA runs end to end (`jaxgpt.train.lora`): only adapters train and are saved, the base is untouched, resume is
bit for bit, another base is refused, and the run loads as base + merged adapters."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from flax import traverse_util
from helpers import load_tiny, train_run
from helpers.runs import final_params

from jaxgpt.errors import UserError
from jaxgpt.io import weights
from jaxgpt.model import lora


@pytest.fixture(scope="module")
def base_run(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Path:
    workdir = tmp_path_factory.mktemp("base") / "run"
    train_run(load_tiny(workdir=str(workdir), data_dir=str(data_dir), max_steps=4, eval_interval=4))
    return workdir


def lora_config(workdir: Path, data_dir: Path, base: Path, max_steps: int):
    c = load_tiny(workdir=str(workdir), data_dir=str(data_dir), max_steps=max_steps, eval_interval=3,
                  ckpt_interval=3, init_from=f"workdir:{base}")
    c.lora.rank, c.lora.alpha, c.lora.dropout = 4, 8.0, 0.1  # dropout: its keys must resume bit for bit too
    return c


def test_only_adapters_train_and_are_saved_and_the_run_loads_merged(tmp_path: Path, data_dir: Path,
                                                                       base_run: Path) -> None:
    base_before = final_params(base_run)
    out = train_run(lora_config(tmp_path / "lora", data_dir, base_run, 6))
    saved = final_params(tmp_path / "lora")
    assert saved and all(path[-1] in ("lora_a", "lora_b") for path in saved)  # no base weights in the checkpoint
    assert {path[-2] for path in saved} == {"q", "k", "v", "o", "up", "down"}
    assert all(np.abs(v).max() > 0 for path, v in saved.items() if path[-1] == "lora_b")  # B trained away from 0
    after = final_params(base_run)
    assert base_before.keys() == after.keys()
    for key in after:
        np.testing.assert_array_equal(base_before[key], after[key])
    adapters = traverse_util.unflatten_dict(saved)
    base = weights.load(f"workdir:{base_run}").params
    merged = weights.load(f"workdir:{tmp_path / 'lora'}").params
    expected = lora.merge(base, adapters, lora.scale(8.0, 4, False))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), merged, expected)
    assert not np.array_equal(merged["h_0"]["attn"]["qkv"]["kernel"], base["h_0"]["attn"]["qkv"]["kernel"])
    assert out["val_loss"] < 10


def test_resume_is_bit_for_bit_and_another_base_is_refused(tmp_path: Path, data_dir: Path, base_run: Path) -> None:
    train_run(lora_config(tmp_path / "straight", data_dir, base_run, 6))
    train_run(lora_config(tmp_path / "resumed", data_dir, base_run, 3))
    train_run(lora_config(tmp_path / "resumed", data_dir, base_run, 6))
    straight, resumed = final_params(tmp_path / "straight"), final_params(tmp_path / "resumed")
    assert straight.keys() == resumed.keys()
    for key in straight:
        np.testing.assert_array_equal(straight[key], resumed[key])
    other = tmp_path / "other_base"
    train_run(load_tiny(workdir=str(other), data_dir=str(data_dir), max_steps=2, eval_interval=2, seed=1))
    with pytest.raises(UserError, match="adapters of another base") as e:
        train_run(lora_config(tmp_path / "resumed", data_dir, other, 9))
    assert "\n" not in str(e.value)


def test_a_chat_run_whose_vocabulary_grew_loads_merged(tmp_path: Path) -> None:
    """Chat adds its special tokens to the base's vocabulary: the run's base is that grown base, rebuilt bit for
    bit (the hash agrees) when the run loads merged."""
    from helpers.chat import ALPHABET, sft_config
    from helpers.models import save_random_lm

    from jaxgpt.data.tokenizer import CharTokenizer
    from jaxgpt.model.config import ModelConfig

    base = tmp_path / "base"
    save_random_lm(base, ModelConfig(vocab_size=len(ALPHABET), block_size=96, n_layer=2, n_head=2, n_embd=32),
                   CharTokenizer(ALPHABET))
    c = sft_config(tmp_path / "chat", base, max_steps=2, eval_interval=2)
    c.lora.rank = 4
    train_run(c)
    loaded = weights.load(f"workdir:{tmp_path / 'chat'}")
    assert loaded.model.vocab_size > len(ALPHABET)
    adapters = traverse_util.unflatten_dict(final_params(tmp_path / "chat"))
    grown = weights.grow_vocab(jax.device_get(weights.load(f"workdir:{base}").params), loaded.model.vocab_size, 0)
    expected = lora.merge(grown, adapters, lora.scale(16.0, 4, False))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), loaded.params, expected)
    from jaxgpt.commands.hf import export  # a PEFT adapter has no place for the grown rows: --merge

    with pytest.raises(UserError, match="--merge"):
        export(str(tmp_path / "chat"), str(tmp_path / "adapter"), "latest", False)
