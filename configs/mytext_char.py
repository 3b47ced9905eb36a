"""Your own text, character level: the quick start's model (4 x 4 x 128, 256 characters of context).

Prepare the text first, then point the config at it (data.dir has no default on purpose):

    jaxgpt data --text my.txt --tokenizer char --out data/my
    python train.py --config configs/mytext_char.py --config.data.dir=data/my

The vocabulary is the set of characters in the text. docs/data.md, "Your own text, character level, from
scratch", continues with sampling, evaluation and export.
"""

from jaxgpt.model.presets import get_preset
from jaxgpt.train.config import base_config, model_fields, schedule


def get_config():
    c = base_config()
    c.workdir = "runs/mytext_char"
    c.data.name = ""  # no built-in dataset: data.dir must name one prepared with `jaxgpt data --text ...`
    c.data.dir = ""
    c.model = model_fields(get_preset("gpt2"), vocab_size=None, block_size=256, n_layer=4, n_head=4, n_embd=128)
    c.batch_size = 32
    c.cpu_devices = 2
    schedule(
        c,
        max_steps=1000,
        lr=3e-3,
        min_lr=3e-4,
        warmup_steps=50,
        weight_decay=0.1,
        b2=0.99,
        eval_interval=250,
        eval_batches=10,
    )
    c.sample.max_new_tokens = 300
    return c
