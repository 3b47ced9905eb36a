"""The quick start with the modern recipe: nanochat's architecture at the quick start's size, Muon, WSD.

The model of configs/stdlib_char.py (4 layers x 4 heads x 128 wide, 256 characters of context, the same data
and batches) built as the "nanochat-d12" preset builds its model: rotary positions, parameter-free RMSNorm (also
after the embedding), QK-norm, ReLU^2, no biases, an untied head, logits soft-capped at 15, zero-initialised
residual projections. Muon trains the hidden matrices (rate 0.02) and AdamW the embedding and head (3e-3, no
weight decay); the rate is held after the warmup and falls linearly to 0 over the last 40% of the run.
`python benchmarks/bench_recipes.py` measures it against the quick start (docs/benchmarks.md, "Two recipes on
the quick start").

    python train.py --config configs/stdlib_modern.py
"""

from jaxgpt.model.presets import get_preset
from jaxgpt.train.config import base_config, model_fields, schedule


def get_config():
    c = base_config()
    c.workdir = "runs/stdlib_modern"
    c.data.name = "stdlib_char"
    c.data.dir = "data/stdlib_char"
    c.model = model_fields(get_preset("nanochat-d12"), vocab_size=None, block_size=256, n_layer=4, n_head=4,
                           n_embd=128)
    c.batch_size = 32
    c.cpu_devices = 2
    schedule(c, max_steps=500, lr=3e-3, min_lr=0.0, warmup_steps=50, weight_decay=0.0, b2=0.99, eval_interval=250,
             eval_batches=10)
    c.optim.update({"optimizer": "muon", "muon_lr": 0.02, "schedule": "wsd", "cooldown_fraction": 0.4,
                    "cooldown_shape": "linear"})
    c.sample.max_new_tokens = 500
    return c
