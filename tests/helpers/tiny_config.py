"""A seconds-sized training config for tests: 2 layers x 32 wide on a small character dataset."""

from jaxgpt.model.presets import get_preset
from jaxgpt.train.config import base_config, model_fields


def get_config():
    c = base_config()
    c.data.name = ""
    c.model = model_fields(get_preset("gpt2"), vocab_size=None, block_size=32, n_layer=2, n_head=2, n_embd=32)
    c.batch_size = 8
    c.max_steps = 40
    c.optim.lr = 3e-3
    c.optim.warmup_steps = 5
    c.log_interval = 5
    c.eval_interval = 20
    c.eval_batches = 2
    c.ckpt_interval = 20
    c.sample.max_new_tokens = 0
    c.compilation_cache_dir = ""
    c.tensorboard = False  # tensorboardX imports torch where it is installed: 1.8 s of each process's 10 s
    return c
