"""Seed 004's one-block Keras GPT (256 wide, 2 heads of key_dim 256, 80 tokens of context) on tiny
Shakespeare with GPT-2 BPE (the seed trained on wine reviews with a 10k-word vocabulary)."""

from jaxgpt.presets import get_preset
from jaxgpt.train_config import base_config, model_fields


def get_config():
    c = base_config()
    c.workdir = "runs/seed004"
    c.data.name = "shakespeare"
    c.data.dir = "data/shakespeare"
    c.model = model_fields(get_preset("seed004"), vocab_size=None)
    c.batch_size = 32
    c.max_steps = 3000
    c.optim.lr = 1e-3
    c.optim.min_lr = 1e-4
    c.optim.warmup_steps = 100
    return c
