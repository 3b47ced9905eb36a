"""Your own text, GPT-2 BPE: fine-tune GPT-2 small (124M) on it, 256 tokens of context.

    jaxgpt data --text my.txt --tokenizer gpt2 --out data/my_bpe
    python train.py --config configs/mytext_gpt2.py --config.data.dir=data/my_bpe

The model keys are left at the base config's, so the architecture comes from the weights in `init_from`
(any GPT-2 size works: --config.init_from=hf:openai-community/gpt2-medium, or a local directory
hf:/path/to/gpt2 offline); block_size only crops the context. `--config.init_from=` trains the same
architecture from scratch instead (slow on a CPU). docs/huggingface.md, "Fine-tune GPT-2 on your text", has the
walk-through.
"""

from jaxgpt.train.config import base_config


def get_config():
    c = base_config()
    c.workdir = "runs/mytext_gpt2"
    c.init_from = "hf:openai-community/gpt2"
    c.data.name = ""  # no built-in dataset: data.dir must name one prepared with `jaxgpt data --tokenizer gpt2`
    c.data.dir = ""
    c.model.block_size = 256  # shorter than GPT-2's 1024 positions: much cheaper, and enough for most texts
    c.model.embd_dropout = c.model.attn_dropout = c.model.resid_dropout = 0.1
    c.batch_size = 8
    c.max_steps = 300
    c.optim.lr = 1e-4
    c.optim.min_lr = 1e-5
    c.optim.warmup_steps = 20
    c.optim.weight_decay = 0.0
    c.eval_interval = 100
    c.eval_batches = 10
    c.ckpt_interval = 100
    c.sample.max_new_tokens = 200
    return c
