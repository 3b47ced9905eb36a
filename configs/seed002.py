"""Seed 002's decoder stack (concatenated sinusoidal positions, scaled embeddings, post-norm "Add & Norm",
per-head key_dim 512) as a character-level language model on tiny Shakespeare, 256 characters of context.
The preset's `pad_id=0` (Keras' mask_zero) is unset here: language-model batches have no padding, and id 0 is
an ordinary character."""

from jaxgpt.model.presets import get_preset
from jaxgpt.train.config import base_config, model_fields


def get_config():
    c = base_config()
    c.workdir = "runs/seed002"
    c.data.name = "shakespeare_char"
    c.data.dir = "data/shakespeare_char"
    c.model = model_fields(get_preset("seed002"), vocab_size=None, block_size=256, pad_id=None)
    c.batch_size = 16
    c.max_steps = 5000
    c.optim.lr = 3e-4
    c.optim.min_lr = 3e-5
    c.optim.warmup_steps = 200
    return c
