"""nanoGPT's "baby GPT" on tiny Shakespeare, character level: 6 layers x 6 heads x 384 wide, 256 context.

Downloads tiny Shakespeare on first use (or prepare it offline: jaxgpt data --text input.txt
--tokenizer char --out data/shakespeare_char).
"""

from jaxgpt.model.presets import get_preset
from jaxgpt.train.config import base_config, model_fields, schedule


def get_config():
    c = base_config()
    c.workdir = "runs/shakespeare_char"
    c.data.name = "shakespeare_char"
    c.data.dir = "data/shakespeare_char"
    c.model = model_fields(
        get_preset("gpt2"),
        vocab_size=None,
        block_size=256,
        n_layer=6,
        n_head=6,
        n_embd=384,
        embd_dropout=0.2,
        attn_dropout=0.2,
        resid_dropout=0.2,
    )
    c.batch_size = 64
    schedule(c, max_steps=5000, lr=1e-3, min_lr=1e-4, warmup_steps=100, b2=0.99, eval_interval=250, eval_batches=20)
    return c
