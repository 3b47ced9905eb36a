"""Seed 001's GPT-1-style model (12 x 768, post-norm, GELU, tied head, positions 1..T) on tiny
Shakespeare with GPT-2 BPE. Its 40,478-token vocabulary becomes the dataset's, and there is no padding
in language-model batches, so `pad_id` is unset here (token 0 is an ordinary BPE token)."""

from jaxgpt.model.presets import get_preset
from jaxgpt.train.config import base_config, model_fields


def get_config():
    c = base_config()
    c.workdir = "runs/seed001"
    c.data.name = "shakespeare"
    c.data.dir = "data/shakespeare"
    c.model = model_fields(get_preset("seed001"), vocab_size=None, pad_id=None)
    c.batch_size = 8
    c.max_steps = 5000
    c.optim.lr = 2.5e-4
    c.optim.min_lr = 2.5e-5
    c.optim.warmup_steps = 200
    return c
