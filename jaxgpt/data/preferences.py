"""Preference pairs for task dpo: TRL's format, a built-in set made from the built-in conversations, and rows.

A pair is a prompt with a chosen and a rejected reply. Files are `.jsonl`, one object per line in TRL's preference
format, `{"prompt": ..., "chosen": ..., "rejected": ...}` (or a Hub dataset of those columns,
`hf:NAME[:SUBSET[:SPLIT]]`, read with `datasets`: `hub_pairs`), either as text (the prompt a user turn, each reply an
assistant turn) or as conversations: the prompt a list of messages (an optional system message, user and assistant
turns alternating, ending with the user's) and each reply a list of one assistant message. Both are rendered in the
run's chat format (`encode_chat`: jaxgpt's or the model's own template, what SFT trains on and `jaxgpt serve`
renders), the prompt followed by the generation prompt, each reply by its end-of-turn token. A bad line is one
UserError FILE:LINE: not JSON, a missing, empty or malformed prompt or reply, or a chosen reply equal to the rejected
one (a Hub dataset's: SPEC row N).

Only the replies' tokens carry the loss. A pair longer than the context (`model.block_size` + 1 ids) is cut as TRL
cuts it, the prompt first: to `max_prompt_length` tokens (its last with truncation_mode "keep_end", its first with
"keep_start"; 0 leaves the prompt whole), then each reply to the room left. A prompt that leaves no room for a
reply is one line naming the pair.

The task lays each pair out as two rows of one width, the prompt followed by each reply (`token_rows`, RL's
rows of a prompt and a completion). `PreferenceConfig` is config.dpo, the task's settings.

The built-in pairs (`builtin_pairs`) are the built-in conversations (`builtin_conversations`, the same seed and
datasets as SFT's): chosen is the right answer and rejected a wrong one close to it, made by a deterministic
corruption (`wrong_answer`: a number off by one or two, one letter changed), so the stage runs offline and the set
is a pure function of the seed (config.dpo.rejected=sampled puts the starting model's own wrong replies in their
place: `jaxgpt.tasks.dpo.rejected`). Pairs are held out by the hash of the prompt (`prompt_key`), SFT's split: an
SFT run on the same settings held out the same prompts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import ClassVar

import numpy as np

from jaxgpt.data.batches import held_out_split
from jaxgpt.data.conversations import (
    Conversation,
    Conversations,
    builtin_conversations,
    conversation_error,
    prompt_key,
)
from jaxgpt.data.hub import hub_rows
from jaxgpt.data.model_chat import encode_chat
from jaxgpt.data.streams import PREFERENCE_STREAM
from jaxgpt.data.tokenizer_base import Tokenizer
from jaxgpt.data.user_files import jsonl_objects
from jaxgpt.errors import UserError

TRUNCATION_MODES = ("keep_end", "keep_start")
# The losses of task dpo (jaxgpt/tasks/dpo/loss.py), and those that use no reference model
DPO_LOSSES = ("sigmoid", "ipo", "hinge", "simpo", "orpo")
REFERENCE_FREE_LOSSES = ("simpo", "orpo")


@dataclasses.dataclass(frozen=True)
class PreferenceConfig(Conversations):
    """Task "dpo": preference tuning on pairs of a chosen and a rejected reply (jaxgpt/tasks/dpo/), from init_from;
    data is "builtin" (pairs made from the built-in conversations of `datasets`), a .jsonl file in TRL's format,
    {"prompt", "chosen", "rejected"} per line, or a Hub dataset of those columns, "hf:NAME[:SUBSET[:SPLIT]]";
    batch_size counts pairs."""

    group: ClassVar[str] = "dpo"
    loss_type: str = "sigmoid"  # "sigmoid" (DPO), "ipo", "hinge", or the reference-free "simpo" and "orpo"
    beta: float = 0.1  # the strength: DPO's beta (a reward is beta x the log-probability ratio to the reference)
    label_smoothing: float = 0.0  # sigmoid and simpo: the share of pairs taken as flipped (conservative DPO)
    simpo_gamma: float = 0.5  # simpo: the target margin between the chosen and rejected rewards
    orpo_lambda: float = 0.1  # orpo: the weight of the odds-ratio term beside the chosen reply's NLL
    rpo_alpha: float = 0.0  # any loss: add this x the chosen reply's mean NLL (TRL's rpo_alpha; 0: none)
    # "precomputed": the starting model's log-probabilities of every pair, computed once before training and kept in
    # the work directory (no reference model held while training); "live": the reference held and run every step
    reference: str = "precomputed"
    max_prompt_length: int = 0  # a pair longer than the context has its prompt cut to this many tokens first (0: no)
    truncation_mode: str = "keep_end"  # which of a cut prompt's tokens stay: "keep_end" (its last) or "keep_start"
    # "builtin": the rejected replies: "corrupted" (the right answer with a number or a letter changed) or "sampled"
    # (the starting model's own wrong replies, sampled once before training; corrupted where it answers right)
    rejected: str = "corrupted"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.loss_type not in DPO_LOSSES:
            raise UserError(f"config.dpo.loss_type={self.loss_type!r} is unknown: choose {', '.join(DPO_LOSSES)}")
        if self.reference not in ("precomputed", "live"):
            raise UserError(f"config.dpo.reference={self.reference!r} is unknown: choose precomputed or live")
        if self.reference == "live" and self.loss_type in REFERENCE_FREE_LOSSES:
            raise UserError(f"config.dpo.loss_type={self.loss_type} uses no reference model: a live reference would "
                            "be run for nothing; leave config.dpo.reference=precomputed (nothing is then computed)")
        if self.rejected not in ("corrupted", "sampled") or (self.rejected == "sampled" and self.data != "builtin"):
            raise UserError(f"config.dpo.rejected={self.rejected!r}: choose corrupted or sampled, which applies to the "
                            "built-in pairs only (config.dpo.data=builtin; a file's pairs have their rejected replies)")
        if self.truncation_mode not in TRUNCATION_MODES:
            raise UserError(f"config.dpo.truncation_mode={self.truncation_mode!r} is unknown: choose "
                            f"{' or '.join(TRUNCATION_MODES)}")
        if (self.beta <= 0 or not 0 <= self.label_smoothing < 0.5
                or min(self.orpo_lambda, self.rpo_alpha, self.max_prompt_length) < 0):
            raise UserError(f"config.dpo: beta={self.beta} must be > 0, label_smoothing={self.label_smoothing} in "
                            f"[0, 0.5), orpo_lambda={self.orpo_lambda}, rpo_alpha={self.rpo_alpha} and "
                            f"max_prompt_length={self.max_prompt_length} >= 0")


FORMAT = '{"prompt": ..., "chosen": ..., "rejected": ...} (text, or lists of messages)'


@dataclasses.dataclass(frozen=True)
class Pair:
    prompt: Conversation  # ends with the user's turn
    chosen: str  # the preferred reply
    rejected: str
    kind: str  # the built-in dataset, or "pairs"
    origin: str  # where it comes from (FILE:LINE), for one-line errors


def _reply(value: object, key: str) -> tuple[str | None, str | None]:
    """(the reply's text, None), or (None, what is wrong with it)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict):
        if value[0].get("role") != "assistant":
            return None, f'"{key}" must be one assistant message, not a {value[0].get("role")!r} message'
        value = value[0].get("content")
    if not isinstance(value, str):
        return None, f'"{key}" must be text or a list of one assistant message'
    if not value.strip():
        return None, f'"{key}" is empty'
    return value, None


def pair_error(obj: object) -> tuple[Pair | None, str | None]:
    """(the pair of one parsed line, None), or (None, what is wrong with it)."""
    if not isinstance(obj, dict):
        return None, f"expected an object {FORMAT}"
    missing = [k for k in ("prompt", "chosen", "rejected") if k not in obj]
    if missing:
        return None, f"no {', '.join(map(repr, missing))}: each line is {FORMAT}"
    prompt = obj["prompt"]
    if isinstance(prompt, str):
        if not prompt.strip():
            return None, '"prompt" is empty'
        prompt = [{"role": "user", "content": prompt}]
    if (error := conversation_error({"messages": prompt}, prompt=True)) is not None:
        return None, f'"prompt": {error}'
    replies = []
    for key in ("chosen", "rejected"):
        text, error = _reply(obj[key], key)
        if error is None:
            error = conversation_error({"messages": [*prompt, {"role": "assistant", "content": text}]})
        if error is not None:
            return None, error
        replies.append(text)
    if replies[0] == replies[1]:
        return None, "chosen equals rejected: the pair prefers nothing"
    messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
    return Pair(messages, replies[0], replies[1], "pairs", ""), None


def checked_pairs(objects: Iterable[tuple[str, object]], where: str) -> list[Pair]:
    """The pairs of (origin, parsed object) items, each with its origin; the first bad one is a UserError naming its
    origin (FILE:LINE, or a Hub dataset's row), none at all one naming `where`."""
    pairs = []
    for origin, obj in objects:
        pair, error = pair_error(obj)
        if error is not None:
            raise UserError(f"{origin}: {error}")
        pairs.append(dataclasses.replace(pair, origin=origin))
    if not pairs:
        raise UserError(f"{where} holds no pairs: give one JSON object per line, {FORMAT}")
    return pairs


def load_pairs(path: str) -> list[Pair]:
    """The pairs of a .jsonl file in TRL's preference format; the first bad line is a UserError FILE:LINE."""
    return checked_pairs(jsonl_objects(path), path)


def hub_pairs(spec: str) -> list[Pair]:
    """The pairs of a Hub dataset in TRL's preference format, `hf:NAME[:SUBSET[:SPLIT]]` (`hub_rows`: without
    `datasets` or a network, one line naming the local route); the first bad row is a UserError SPEC row N."""
    rows = hub_rows(spec, "config.dpo.data", ("prompt", "chosen", "rejected"), f"TRL's preference format, {FORMAT}",
                    "pairs.jsonl")
    return checked_pairs(((f"{spec} row {n}", row) for n, row in enumerate(rows)), spec)


def wrong_answer(answer: str, rng: np.random.Generator) -> str:
    """A wrong answer close to `answer`: a final number (a sum, a count's total, a lucky number) off by 1 or 2
    (never negative), else one character changed to another letter."""
    head, sep, last = answer.rpartition(": ")
    if last.isdigit():
        n, delta = int(last), int(rng.choice([-2, -1, 1, 2]))
        return f"{head}{sep}{n + delta if n + delta >= 0 else n - delta}"
    i = int(rng.integers(len(answer)))
    letters = [c for c in "abcdefghijklmnopqrstuvwxyz" if c != answer[i].lower()]
    return answer[:i] + letters[int(rng.integers(len(letters)))] + answer[i + 1:]


def builtin_pairs(seed: int, n: int, datasets: Sequence[str]) -> list[Pair]:
    """`n` pairs of the built-in conversations `builtin_conversations(seed, n, datasets)`: each conversation's
    answer is chosen, `wrong_answer` of it rejected (a pure function of (seed, n, datasets))."""
    rng = np.random.Generator(np.random.PCG64([seed, PREFERENCE_STREAM]))
    return [Pair(conv[:-1], conv[-1]["content"], wrong_answer(conv[-1]["content"], rng), datasets[i % len(datasets)],
                 f"built-in pair {i}")
            for i, conv in enumerate(builtin_conversations(seed, n, datasets))]


def split_pairs(pairs: list[Pair], val_fraction: float) -> tuple[list[Pair], list[Pair]]:
    """(train, held out) by SFT's split (a hash of the prompt, `prompt_key`)."""
    return held_out_split(pairs, lambda p: prompt_key(p.prompt), val_fraction, "pairs", "config.dpo.val_fraction")


@dataclasses.dataclass(frozen=True)
class EncodedPair:
    prompt: list[int]  # ending with <|assistant|>
    chosen: list[int]  # the reply's ids, ending with the end token unless cut
    rejected: list[int]
    cut: bool  # the pair was longer than the context


def encode_pair(tokenizer: Tokenizer, pair: Pair, limit: int, max_prompt_length: int,
                truncation_mode: str) -> EncodedPair:
    """The pair's ids in the run's chat format (jaxgpt's or the model's own template: `encode_chat`), cut to
    `limit` ids per sequence (the module docstring); a reply the tokenizer cannot write, or a prompt that leaves
    no room, is a UserError naming the pair."""
    replies = []
    try:
        for reply in (pair.chosen, pair.rejected):
            encoded = encode_chat(tokenizer, [*pair.prompt, {"role": "assistant", "content": reply}])
            # the reply: its first token (the prompt ends with the generation prompt) through its end-of-turn token
            # (not the newline a template may write after it)
            start, stop = np.flatnonzero(encoded.answer)[[0, -1]]
            replies.append(encoded.ids[start:stop + 1].tolist())
    except UserError as e:
        raise UserError(f"{pair.origin}: {e}") from None
    prompt = encoded.ids[:start].tolist()
    longer = max(map(len, replies))
    cut = len(prompt) + longer > limit
    if cut and max_prompt_length:
        prompt = prompt[-max_prompt_length:] if truncation_mode == "keep_end" else prompt[:max_prompt_length]
    if len(prompt) >= limit:
        raise UserError(f"{pair.origin}: the prompt's {len(prompt)} tokens leave no room for a reply in "
                        f"model.block_size={limit - 1}: set config.dpo.max_prompt_length below it (prompts are then "
                        "cut) or raise model.block_size")
    room = limit - len(prompt)
    return EncodedPair(prompt, replies[0][:room], replies[1][:room], cut)

