"""Sequence-to-sequence quick start: the encoder-decoder learns to copy random symbol strings (no download).

The Annotated Transformer's first exercise, a little harder: sources are random strings of 1-20 symbols
out of 20 (its were 10 of 10), the target is the same string; 5% of 20,000 generated strings are held out.
2 encoder + 2 decoder layers, 4 heads, 128 wide, trained with teacher forcing; every evaluation decodes the
held-out sources greedily and reports exact match. See docs/benchmarks.md (Encoder-decoder) for the time and
exact match measured on 2 CPU cores.

    python train.py --config configs/seq2seq_copy.py [--config.seq2seq.data=reverse]
"""

from jaxgpt.model.presets import get_preset
from jaxgpt.train.config import base_config, model_fields


def get_config():
    c = base_config()
    c.task = "seq2seq"
    c.workdir = "runs/seq2seq_copy"
    c.seq2seq.data = "copy"
    c.seq2seq.examples = 20000
    c.seq2seq.symbols = 20
    c.seq2seq.length = 20
    c.seq2seq.n_encoder_layer = 2
    c.model = model_fields(get_preset("gpt2"), vocab_size=None, block_size=64, n_layer=2, n_head=4, n_embd=128)
    c.batch_size = 64
    c.cpu_devices = 2
    c.max_steps = 800
    c.optim.lr = 1e-3
    c.optim.min_lr = 1e-4
    c.optim.warmup_steps = 100
    c.optim.weight_decay = 0.01
    c.optim.b2 = 0.98
    c.eval_interval = 200
    c.eval_batches = 20  # up to 20 x 64 rows: every held-out pair
    c.ckpt_interval = 400
    c.keep_checkpoints = 1
    return c
