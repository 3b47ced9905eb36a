"""Sequence to sequence on real text, no download: reverse the words of the standard library's identifiers.

Sources are the distinct snake_case identifiers of the running interpreter's standard library (about 9,000
on Python 3.11), targets their words in reverse order (`get_default_value` -> `value_default_get`); 10% of
the identifiers are held out, so exact match is measured on word combinations never seen in training.
Character level, 3 encoder + 3 decoder layers, 4 heads, 128 wide.

    python train.py --config configs/seq2seq_stdlib.py
"""

from jaxgpt.model.presets import get_preset
from jaxgpt.train.config import base_config, model_fields


def get_config():
    c = base_config()
    c.task = "seq2seq"
    c.workdir = "runs/seq2seq_stdlib"
    c.seq2seq.data = "stdlib_identifiers"
    c.seq2seq.val_fraction = 0.1
    c.seq2seq.n_encoder_layer = 3
    c.model = model_fields(get_preset("gpt2"), vocab_size=None, block_size=64, n_layer=3, n_head=4, n_embd=128)
    c.batch_size = 64
    c.cpu_devices = 2
    c.max_steps = 1000
    c.optim.lr = 1e-3
    c.optim.min_lr = 1e-4
    c.optim.warmup_steps = 100
    c.optim.weight_decay = 0.01
    c.optim.b2 = 0.98
    c.label_smoothing = 0.1
    c.eval_interval = 250
    c.eval_batches = 16  # 16 x 64 rows: every held-out identifier
    c.ckpt_interval = 500
    c.keep_checkpoints = 1
    return c
