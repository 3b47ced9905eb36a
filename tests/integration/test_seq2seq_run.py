"""The seq2seq task on the training loop: it learns, checkpoints, resumes exactly, and its weights load as an
encoder-decoder that the GPT-only readers refuse in one line."""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import logged_records
from helpers.seq2seq import task_config

from jaxgpt.data import pairs
from jaxgpt.errors import UserError
from jaxgpt.generate.seq2seq import greedy
from jaxgpt.io import weights
from jaxgpt.model.config import Seq2SeqConfig
from jaxgpt.train.config import from_config_dict


def test_trains_checkpoints_resumes_exactly_and_loads_as_encoder_decoder(tmp_path: Path) -> None:
    from jaxgpt.tasks import build
    from jaxgpt.train.loop import train

    whole_dir, split_dir = tmp_path / "whole", tmp_path / "split"
    whole = train(from_config_dict(task_config(tmp_path, workdir=str(whole_dir))), build)
    evals = logged_records(whole_dir)
    val_losses = [row["val_loss"] for row in evals if "val_loss" in row]
    assert len(val_losses) == 2 and val_losses[1] < val_losses[0] < np.log(9)  # chance: 6 symbols + 3 specials
    assert 0 <= whole["val_exact_match"] <= 1 and whole["val_pairs"] == 32
    shutil.copytree(whole_dir, split_dir)  # the run as it was when it stopped after step 20
    shutil.rmtree(split_dir / "checkpoints" / "40")
    resumed = train(from_config_dict(task_config(tmp_path, workdir=str(split_dir))), build)
    assert resumed["steps"] == 20 and resumed["val_loss"] == whole["val_loss"]
    for a, b in zip(jax.tree.leaves(whole["state"]["params"]), jax.tree.leaves(resumed["state"]["params"]),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    loaded = weights.load(f"workdir:{whole_dir}")
    assert isinstance(loaded.model, Seq2SeqConfig) and loaded.meta["seq2seq"] == pairs.SPECIALS
    assert weights.describe(f"workdir:{whole_dir}")[0] == loaded.model
    S, T = loaded.model.src_block_size, loaded.model.model.block_size
    src = jnp.asarray([pairs.encode_text(loaded.tokenizer(), pairs.SPECIALS, "abc") + [0] * (S - 3)])
    assert greedy(loaded.params, loaded.model, src, bos_id=1, eos_id=2, max_new_tokens=T).shape == (1, T)
    with pytest.raises(UserError, match="encoder-decoder"):
        weights.fit_architecture(f"workdir:{whole_dir}", loaded.model.model, {}, True)
    from jaxgpt.commands.hf import export
    from jaxgpt.tasks.classify import language_model

    with pytest.raises(UserError, match="cannot be exported"):  # the GPT-only readers refuse it in one line
        export(str(whole_dir), str(tmp_path / "hf"), "latest", False)
    assert not (tmp_path / "hf").exists()
    with pytest.raises(UserError, match="cannot be fine-tuned as a classifier"):
        language_model(f"workdir:{whole_dir}", None)
