"""The built-in pairs' rejected replies written by the starting model itself (config.dpo.rejected=sampled).

The issue with a corrupted answer as the rejected reply (`jaxgpt.data.preferences.wrong_answer`) is that it is not a
mistake the model makes: DPO then pushes down replies the model would not write. With `sampled`, each pair's prompt
is answered once by the starting model (init_from: the SFT model), sampled at temperature 1 through the serving
engine, each reply with its own seed (a pure function of (seed, pair)); a reply that ends, is not empty and is not
the right answer becomes the pair's rejected reply, and the pairs the model answers right keep the corrupted one.
This runs once, before training, and the replies are kept in the work directory (`REJECTED_FILE`, one JSON string
per pair), so a resumed run reads them back instead of sampling again.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jaxgpt import storage
from jaxgpt.data.conversations import SPECIAL_TOKENS
from jaxgpt.data.preferences import Pair
from jaxgpt.data.streams import REJECTED_STREAM
from jaxgpt.data.tokenizer_base import Tokenizer
from jaxgpt.generate.many import generate_many
from jaxgpt.generate.text_stream import until_eot
from jaxgpt.model.config import ModelConfig
from jaxgpt.tasks.rl.prompts import Prompt
from jaxgpt.tasks.rl.rollouts import encode_prompts, request_seed

REJECTED_FILE = "rejected.jsonl"  # in the work directory: every pair's rejected reply, in the pairs' order
MAX_NEW_TOKENS = 48  # a sampled reply's longest (the built-in answers are at most about 20 characters)


def saved_rejections(workdir: str, n: int) -> list[str] | None:
    """The rejected replies a run of `n` pairs kept in `workdir`, or None when it holds none (or not for n)."""
    path = storage.location(workdir, "config.workdir") / REJECTED_FILE
    with storage.guard(path, "reading the sampled rejected replies from"):
        if not path.exists():
            return None
        replies = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return replies if len(replies) == n else None


def sample_rejections(pairs: list[Pair], params: Any, model_cfg: ModelConfig, tokenizer: Tokenizer,
                      end_id: int, seed: int, slots: int) -> list[str]:
    """Each pair's rejected reply: the model's own sampled reply when it is wrong, else the pair's (corrupted) one."""
    prompts = [Prompt(p.prompt, p.chosen, p.kind, p.origin) for p in pairs]
    kept, _ = encode_prompts(prompts, tokenizer, model_cfg.block_size, MAX_NEW_TOKENS)
    index = {id(p): i for i, p in enumerate(prompts)}
    rows = [index[id(p)] for p in kept.prompts]
    replies = generate_many(params, model_cfg, kept.ids, max_new_tokens=kept.room,
                            seeds=[request_seed(seed, REJECTED_STREAM, i) for i in rows], temperature=1.0,
                            eot_token=end_id, vocab_limit=tokenizer.vocab_size, slots=slots)
    rejected = [p.rejected for p in pairs]
    for i, tokens in zip(rows, replies, strict=True):
        if end_id not in tokens:
            continue  # cut at its room: not a reply the model finished
        text = tokenizer.decode(until_eot(tokens, end_id))
        if text.strip() and text.strip() != pairs[i].chosen.strip() and not any(s in text for s in SPECIAL_TOKENS):
            rejected[i] = text
    return rejected


def with_rejections(pairs: list[Pair], rejected: list[str]) -> list[Pair]:
    return [dataclasses.replace(p, rejected=r) for p, r in zip(pairs, rejected, strict=True)]


def rejections_file(rejected: list[str]) -> str:
    """The text of REJECTED_FILE for these replies."""
    return "".join(json.dumps(r) + "\n" for r in rejected)
