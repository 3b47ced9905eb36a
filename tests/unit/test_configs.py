"""Every shipped config loads, resolves to valid typed configs, and builds its model abstractly."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from helpers import ROOT

from jaxgpt.model.config import Seq2SeqConfig
from jaxgpt.model.encdec import Seq2SeqModel
from jaxgpt.model.gpt import GPT
from jaxgpt.train.config import from_config_dict

CONFIGS = sorted(p for p in (ROOT / "configs").glob("*.py")
                 if not p.stem.startswith("classify_"))  # classification configs: tests/unit/tasks/test_classify.py


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_resolves_and_builds(path: Path) -> None:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    cfg = from_config_dict(c)
    if cfg.vocab_from_data:
        cfg = cfg.with_model(cfg.model.replace(vocab_size=50257 if c.data.name in ("shakespeare", "openwebtext")
                                               else 100))
    assert cfg.workdir and cfg.optim.decay_steps >= cfg.optim.warmup_steps
    idx = jnp.zeros((1, 4), jnp.int32)
    if cfg.task == "seq2seq":  # the encoder-decoder's sizes besides the model's come from config.seq2seq
        model = Seq2SeqModel(Seq2SeqConfig(cfg.model.replace(pad_id=0), n_encoder_layer=cfg.seq2seq.n_encoder_layer,
                                             share_embeddings=cfg.seq2seq.share_embeddings))
        shapes = jax.eval_shape(model.init, jax.random.key(0), idx, idx)
    else:
        shapes = jax.eval_shape(GPT(cfg.model).init, jax.random.key(0), idx)
    assert shapes["params"]


def test_the_config_dict_is_derived_from_the_dataclasses_and_converted_back() -> None:
    """base_config() holds exactly TrainConfig's keys; a key a config file invents is one error with a suggestion."""
    import dataclasses

    import pytest

    from jaxgpt.errors import UserError
    from jaxgpt.train.config import TrainConfig, base_config, from_config_dict

    c = base_config()
    keys = {f.name for f in dataclasses.fields(TrainConfig) if not f.metadata.get("derived")}
    assert set(c.keys()) == keys
    c.workdir = "runs/x"
    assert from_config_dict(c).optim.decay_steps == c.max_steps  # unset: the run's length
    c.optim.lrr = 1.0  # a config file may add keys to its (unlocked) ConfigDict
    with pytest.raises(UserError, match=r"config.optim.lrr is not a config key: did you mean optim.lr\?"):
        from_config_dict(c)


def test_renamed_keys_still_configure_what_they_did(capsys: pytest.CaptureFixture) -> None:
    """chat.tasks is chat.datasets under its old name; an RL config that sets its prompts under chat (as before they
    moved to config.rl) gets them under rl, with one warning; the typed config holds the new names only."""
    from jaxgpt.train.config import base_config

    c = base_config()
    c.workdir, c.chat.tasks = "runs/x", "reverse"
    cfg = from_config_dict(c)
    assert cfg.chat.datasets == "reverse" and cfg.settings["chat"]["datasets"] == "reverse"
    assert capsys.readouterr().err == ""
    c.task, c.init_from, c.chat.examples, c.rl.val_fraction = "rl", "workdir:runs/sft", 300, 0.2
    cfg = from_config_dict(c)
    assert (cfg.rl.datasets, cfg.rl.examples, cfg.rl.val_fraction) == ("reverse", 300, 0.2)
    assert cfg.settings["rl"]["examples"] == 300
    assert capsys.readouterr().err == ("warning: RL's prompts are configured under config.rl now: read "
                                       "config.chat.{datasets,examples} as config.rl.{datasets,examples} (set those "
                                       "instead)\n")


def test_seed_names_stay_aliases_of_the_descriptive_presets() -> None:
    """Old configs and commands that name a preset by its seed keep working; listings show the new names."""
    from jaxgpt.model.presets import ALIASES, PRESETS, SEQ2SEQ_PRESETS, get_preset, get_seq2seq_preset

    for old, new in ALIASES.items():
        table, get = (SEQ2SEQ_PRESETS, get_seq2seq_preset) if old.endswith("-encdec") else (PRESETS, get_preset)
        assert old not in list(table) and new in list(table) and old in table
        assert get(old) is table[new] is table[old]
