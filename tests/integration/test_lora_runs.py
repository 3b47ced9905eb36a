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


def test_a_qlora_run_holds_a_4bit_base_and_trains(tmp_path: Path, data_dir: Path, base_run: Path) -> None:
    from jaxgpt.tasks import build
    from jaxgpt.train.config import from_config_dict

    c = lora_config(tmp_path / "qlora", data_dir, base_run, 6)
    c.lora.quantize, c.lora.quantize_group = "nf4", 16
    task = build(from_config_dict(c))
    fc = task.base["h_0"]["mlp"]["fc"]
    assert "kernel" not in fc and fc["kernel_q"].dtype == np.uint8  # what Program.frozen places and every step gets
    out = train_run(c)
    saved = final_params(tmp_path / "qlora")
    assert all(np.abs(v).max() > 0 for path, v in saved.items() if path[-1] == "lora_b")
    assert out["val_loss"] < 10


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


def saving_config(workdir: Path, data_dir: Path, base: Path, max_steps: int):
    c = lora_config(workdir, data_dir, base, max_steps)
    c.lora.modules_to_save = "wte,ln_f"
    return c


def test_modules_to_save_train_in_full_beside_the_adapters_and_load_merged(tmp_path: Path, data_dir: Path,
                                                                          base_run: Path) -> None:
    """Gradients reach the adapters and the saved parameters only: the checkpoint holds just those (with their
    optimizer moments), the base run's bytes are unchanged, and the run loads as the base with the saved
    parameters replaced and the adapters merged, every other weight the base's bit for bit."""
    base_before = final_params(base_run)
    out = train_run(saving_config(tmp_path / "lora", data_dir, base_run, 6))
    saved = final_params(tmp_path / "lora")
    full = {path[1:]: v for path, v in saved.items() if path[0] == lora.SAVED}
    assert set(full) == {("wte", "embedding"), ("ln_f", "scale"), ("ln_f", "bias")}
    assert all(path[-1] in ("lora_a", "lora_b") for path in saved if path[0] != lora.SAVED)
    for path, value in full.items():
        assert value.shape == base_before[path].shape and not np.array_equal(value, base_before[path]), path
    moments = [x for x in jax.tree.leaves(out["state"]["opt_state"]) if np.ndim(x)]
    assert sum(np.size(x) for x in moments) == 2 * sum(v.size for v in saved.values())  # Adam's mu and nu
    after = final_params(base_run)
    for key in after:
        np.testing.assert_array_equal(base_before[key], after[key])
    base = weights.load(f"workdir:{base_run}").params
    merged = weights.load(f"workdir:{tmp_path / 'lora'}").params
    expected = lora.merge(base, traverse_util.unflatten_dict(saved), lora.scale(8.0, 4, False))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), merged, expected)
    flat_merged, flat_base = traverse_util.flatten_dict(merged), traverse_util.flatten_dict(base)
    for path, value in flat_merged.items():
        if path in full:
            np.testing.assert_array_equal(value, full[path])
        elif path[-1] != "kernel" or path[-2] not in ("qkv", "out", "fc", "proj"):  # not adapted: the base's
            np.testing.assert_array_equal(value, flat_base[path])


def test_modules_to_save_resume_bit_for_bit(tmp_path: Path, data_dir: Path, base_run: Path) -> None:
    train_run(saving_config(tmp_path / "straight", data_dir, base_run, 6))
    train_run(saving_config(tmp_path / "resumed", data_dir, base_run, 3))
    train_run(saving_config(tmp_path / "resumed", data_dir, base_run, 6))
    straight, resumed = final_params(tmp_path / "straight"), final_params(tmp_path / "resumed")
    assert straight.keys() == resumed.keys() and any(path[0] == lora.SAVED for path in straight)
    for key in straight:
        np.testing.assert_array_equal(straight[key], resumed[key])


@pytest.mark.parametrize(("patterns", "targets", "message"), [
    ("wte,ln_x", "", "'ln_x' matches no parameter.*fix or drop it"),
    ("qkv", "", "'qkv' matches h_0/attn/qkv/kernel, which LoRA adapts \\(q,k,v\\)"),
    ("wte", "q,embed", "LoRA adapts \\(embed\\).*drop embed from config.lora.targets"),
])
def test_modules_to_save_that_match_nothing_or_an_adapted_weight_are_refused(
        tmp_path: Path, data_dir: Path, base_run: Path, patterns: str, targets: str, message: str) -> None:
    from jaxgpt.tasks import build
    from jaxgpt.train.config import from_config_dict

    c = lora_config(tmp_path / "bad", data_dir, base_run, 2)
    c.lora.modules_to_save, c.lora.targets = patterns, targets
    with pytest.raises(UserError, match=message) as e:
        build(from_config_dict(c))
    assert "\n" not in str(e.value)
