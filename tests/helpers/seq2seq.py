"""A tiny encoder-decoder for tests, and its random weights."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
from reference import numpy_reference_seq2seq as ref2

from jaxgpt.model.config import Seq2SeqConfig
from jaxgpt.model.presets import get_preset
from jaxgpt.train.config import base_config, model_fields

PAD, BOS = 0, 1


TINY = dict(vocab_size=11, src_vocab_size=13, block_size=8, src_block_size=9, n_layer=2, n_encoder_layer=2,
            n_embd=16, n_head=2, d_ff=24, pad_id=PAD)


def tiny(**changes) -> Seq2SeqConfig:
    return Seq2SeqConfig().replace(**{**TINY, **changes})


def random_params(cfg: Seq2SeqConfig, seed: int = 0) -> dict:
    """Weights large enough for peaked, seed-dependent distributions (random init is nearly uniform)."""
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), ref2.random_params(cfg.to_dict(), seed=seed, std=0.4))


def task_config(tmp_path: Path, **overrides: object) -> object:
    """A training config of the seq2seq task on the built-in reverse pairs, tiny enough to train in seconds."""
    c = base_config()
    c.task, c.workdir, c.compilation_cache_dir = "seq2seq", str(tmp_path / "run"), str(tmp_path / "xla")
    c.seq2seq.data, c.seq2seq.examples, c.seq2seq.symbols, c.seq2seq.length = "reverse", 2000, 6, 6
    c.seq2seq.val_fraction, c.seq2seq.n_encoder_layer = 0.1, 1
    c.model = model_fields(get_preset("gpt2"), vocab_size=None, block_size=16, n_layer=1, n_head=2, n_embd=32)
    c.batch_size, c.max_steps, c.log_interval, c.eval_interval, c.ckpt_interval = 16, 40, 10, 20, 20
    c.eval_batches = 2
    c.optim.lr, c.optim.warmup_steps = 1e-2, 5
    for key, value in overrides.items():
        c[key] = value
    return c
