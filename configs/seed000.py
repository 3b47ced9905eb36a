"""Seed 000's GPT (the Annotated Transformer's decoder as a GPT) trained on tiny Shakespeare with its
tokenizer, tiktoken's r50k / GPT-2 BPE: 6 x 512, 8 heads, pre-norm, sinusoidal positions, ReLU, Xavier.
"""

from jaxgpt.model.presets import get_preset
from jaxgpt.train.config import base_config, model_fields


def get_config():
    c = base_config()
    c.workdir = "runs/seed000"
    c.data.name = "shakespeare"
    c.data.dir = "data/shakespeare"
    c.model = model_fields(get_preset("seed000"), block_size=256)
    c.batch_size = 16
    c.max_steps = 5000
    c.optim.lr = 3e-4
    c.optim.min_lr = 3e-5
    c.optim.warmup_steps = 200
    return c
