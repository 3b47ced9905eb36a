"""Chat runs for tests: the built-in conversations' alphabet, the template as the server renders it, an SFT config."""

from __future__ import annotations

from pathlib import Path

from jaxgpt.data.conversations import CHAT_TEMPLATE, END, ChatTemplate
from jaxgpt.train.config import base_config

# Every character of the built-in conversations, sorted by code point as CharTokenizer requires.
ALPHABET = "".join(sorted(set(" !'+-.:?0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")))


def save_char_base(workdir: Path) -> Path:
    """A one-layer character model of the built-in conversations' alphabet, random weights, saved as a run: the
    start of the chat tasks' runs on the loop (RL, DPO)."""
    from helpers.models import save_random_lm
    from jaxgpt.data.tokenizer import CharTokenizer
    from jaxgpt.model.config import ModelConfig

    save_random_lm(workdir, ModelConfig(vocab_size=len(ALPHABET), block_size=64, n_layer=1, n_head=2, n_embd=32),
                   CharTokenizer(ALPHABET))
    return workdir


def render(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """The template as `jaxgpt serve` renders it (the one ChatTemplate, as `jaxgpt serve` builds it)."""
    return ChatTemplate(CHAT_TEMPLATE, eos_token=END).render(messages, add_generation_prompt)


def sft_config(workdir: Path, base: Path, **overrides: object):
    c = base_config()
    c.task, c.workdir, c.init_from = "chat", str(workdir), f"workdir:{base}"
    c.chat.examples, c.chat.val_fraction = 200, 0.1
    c.batch_size, c.max_steps, c.eval_interval, c.log_interval, c.eval_batches = 8, 12, 6, 6, 2
    c.optim.lr, c.optim.warmup_steps = 3e-3, 5
    c.compilation_cache_dir = ""
    c.update_from_flattened_dict(overrides)
    return c
