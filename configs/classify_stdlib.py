"""Classification fine-tuning quick start: which standard-library package does a snippet come from?

Fine-tunes the character model of configs/stdlib_char.py (train it first:
`python train.py --config configs/stdlib_char.py --config.workdir=runs/stdlib_char`) on the built-in
`stdlib_packages` task: 128-character snippets of asyncio / email / unittest / xml, 4 balanced classes,
held-out snippets from files no training snippet comes from. The classification token is "\\n" appended
to each snippet (a character model has no spare token; see jaxgpt/data/classify_data.py).

    python train.py --config configs/classify_stdlib.py \\
        [--config.init_from=workdir:runs/stdlib_char] [--config.workdir=runs/classify_stdlib]

Any CSV/JSONL of (text, label) works the same way: --config.classify.data=path/to/file.csv.
"""

from jaxgpt.train.config import base_config


def get_config():
    c = base_config()
    c.task = "classify"
    c.workdir = "runs/classify_stdlib"
    c.init_from = "workdir:runs/stdlib_char"
    c.classify.data = "stdlib_packages"
    c.classify.val_fraction = 0.2
    c.classify.lm_weight = 0.5
    c.classify.cls_dropout = 0.1
    c.batch_size = 32
    c.max_steps = 300
    c.optim.lr = 1e-3
    c.optim.min_lr = 1e-4
    c.optim.warmup_steps = 30
    c.optim.weight_decay = 0.1
    c.optim.b2 = 0.99
    c.eval_interval = 100
    c.ckpt_interval = 100
    c.keep_checkpoints = 1
    return c
