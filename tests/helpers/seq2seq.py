"""A tiny encoder-decoder for tests, and its random weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from reference import numpy_reference_seq2seq as ref2

from jaxgpt.model.config import Seq2SeqConfig

PAD, BOS = 0, 1


TINY = dict(vocab_size=11, src_vocab_size=13, block_size=8, src_block_size=9, n_layer=2, n_encoder_layer=2,
            n_embd=16, n_head=2, d_ff=24, pad_id=PAD)


def tiny(**changes) -> Seq2SeqConfig:
    return Seq2SeqConfig().replace(**{**TINY, **changes})


def random_params(cfg: Seq2SeqConfig, seed: int = 0) -> dict:
    """Weights large enough for peaked, seed-dependent distributions (random init is nearly uniform)."""
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), ref2.random_params(cfg.to_dict(), seed=seed, std=0.4))
