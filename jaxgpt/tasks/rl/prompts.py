"""Prompts of task rl: config.rl's conversations without their last assistant turn, which becomes the answer.

From `config.rl.data` (the same keys as config.chat's, `Conversations`):
* "builtin": the seeded built-in conversations of `config.rl.datasets` (`builtin_conversations`), so the prompts
  and their held-out split are those an SFT run on the same settings saw and held out;
* a `.jsonl` file, one object per line: SFT's `{"messages": [..., assistant]}` (the last assistant turn is the
  answer), or `{"messages": [..., user], "answer": "..."}`, or a prompt alone `{"messages": [..., user]}` for
  rewards that need no answer; a bad line is one UserError FILE:LINE;
* `hf:NAME[:SUBSET[:SPLIT]]`: a Hub dataset of conversations (`load_hub`), the last assistant turn the answer.

Held-out prompts are split by a hash of the prompt (everything before the answer, `prompt_key`), as SFT splits
its conversations: a prompt SFT held out is held out here too.
"""

from __future__ import annotations

import dataclasses

from jaxgpt.data.batches import held_out_split
from jaxgpt.data.conversations import (
    Conversation,
    Conversations,
    conversation_error,
    prompt_key,
)
from jaxgpt.data.user_files import jsonl_objects
from jaxgpt.errors import UserError
from jaxgpt.tasks.chat import configured_conversations


@dataclasses.dataclass(frozen=True)
class Prompt:
    messages: Conversation  # ends with the user's turn
    answer: str | None  # what the built-in checker compares with (None: no answer given)
    kind: str  # the built-in dataset, or "conversations"
    origin: str  # where it comes from, for one-line errors


def _jsonl_prompt(obj: object, origin: str) -> Prompt:
    """One parsed line as a prompt; a UserError naming `origin` when it is none of the three forms."""
    if isinstance(obj, dict) and "answer" in obj and not isinstance(obj["answer"], str):
        raise UserError(f'{origin}: "answer" must be a string')
    ends_with_user = isinstance(obj, dict) and isinstance(obj.get("messages"), list) and bool(obj["messages"]) and (
        isinstance(obj["messages"][-1], dict) and obj["messages"][-1].get("role") == "user")
    if (error := conversation_error(obj, prompt=ends_with_user)) is not None:
        raise UserError(f"{origin}: {error}")
    messages = [{"role": m["role"], "content": m["content"]} for m in obj["messages"]]
    if ends_with_user:
        return Prompt(messages, obj.get("answer"), "conversations", origin)
    return Prompt(messages[:-1], obj.get("answer", messages[-1]["content"]), "conversations", origin)


def _load_jsonl(path: str) -> list[Prompt]:
    prompts = [_jsonl_prompt(obj, where) for where, obj in jsonl_objects(path)]
    if not prompts:
        raise UserError(f'{path} holds no prompts: give one JSON object per line, {{"messages": [{{"role": "user", '
                        '"content": ...}], "answer": ...}')
    return prompts


def load_prompts(c: Conversations, seed: int) -> tuple[list[Prompt], str]:
    """(prompts, a description) of config.rl's data: a JSONL file of prompts read here (`_jsonl_prompt`'s three
    forms), else SFT's conversations (`chat.configured_conversations`: built-in or from the Hub), each without its
    last turn, which is the answer."""
    if c.data.endswith(".jsonl"):
        prompts = _load_jsonl(c.data)
        return prompts, f"{len(prompts)} prompts from {c.data}"
    conversations, origins, kinds, description = configured_conversations(c, seed)
    return [Prompt(conv[:-1], conv[-1]["content"], kind, origin)
            for conv, origin, kind in zip(conversations, origins, kinds, strict=True)], description


def split_prompts(prompts: list[Prompt], val_fraction: float) -> tuple[list[Prompt], list[Prompt]]:
    """(train, held out) by SFT's split (a hash of the prompt, `prompt_key`)."""
    return held_out_split(prompts, lambda p: prompt_key(p.messages), val_fraction, "prompts",
                          "config.rl.val_fraction")
