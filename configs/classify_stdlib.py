"""Classification fine-tuning quick start: which standard-library package does a snippet come from?

Fine-tunes the character model of configs/stdlib_char.py (train it first:
`python train.py --config configs/stdlib_char.py --config.workdir=runs/stdlib_char`) on the built-in
`stdlib_packages` task: 128-character snippets of asyncio / email / unittest / xml, 4 balanced classes,
held-out snippets from files no training snippet comes from. The classification token is "\\n" appended
to each snippet (a character model has no spare token; see jaxgpt/classify.py).

    python -m jaxgpt.classify --config configs/classify_stdlib.py \\
        [--config.init_from=workdir:runs/stdlib_char] [--config.workdir=runs/classify_stdlib]

Any CSV/JSONL of (text, label) works the same way: --config.data=path/to/file.csv.
"""

from jaxgpt.classify import base_config


def get_config():
    c = base_config()
    c.workdir = "runs/classify_stdlib"
    c.init_from = "workdir:runs/stdlib_char"
    c.data = "stdlib_packages"
    c.val_fraction = 0.2
    c.lm_weight = 0.5
    c.cls_dropout = 0.1
    c.batch_size = 32
    c.steps = 300
    c.optim.lr = 1e-3
    c.optim.min_lr = 1e-4
    c.optim.warmup_steps = 30
    c.optim.weight_decay = 0.1
    c.optim.b2 = 0.99
    c.eval_interval = 100
    return c
