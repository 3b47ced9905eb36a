"""Quick start: a small character-level GPT on the Python standard library's sources (no download).

4 layers x 4 heads x 128 wide, 256 characters of context; 700 steps of 32 x 256 characters (5.7M), data
parallel over two CPU devices. See README.md (Quick start) for the time and validation loss measured on a 2-core
machine.
"""

from jaxgpt.model.presets import get_preset
from jaxgpt.train.config import base_config, model_fields, schedule


def get_config():
    c = base_config()
    c.workdir = "runs/stdlib_char"
    c.data.name = "stdlib_char"
    c.data.dir = "data/stdlib_char"
    c.model = model_fields(get_preset("gpt2"), vocab_size=None, block_size=256, n_layer=4, n_head=4, n_embd=128)
    c.batch_size = 32
    c.cpu_devices = 2  # on a CPU host, two data-parallel XLA devices: ~20% faster for a model this small
    schedule(
        c,
        max_steps=700,
        lr=3e-3,
        min_lr=3e-4,
        warmup_steps=50,
        weight_decay=0.1,
        b2=0.99,
        eval_interval=350,
        eval_batches=10,
    )
    c.sample.max_new_tokens = 500
    return c
