"""Conversations for chat fine-tuning: the OpenAI `messages` format, jaxgpt's chat format, and built-in datasets.

A conversation is a list of messages `{"role": ..., "content": ...}`: an optional system message first, then
user and assistant turns alternating, starting with a user turn and ending with an assistant turn. Files are
`.jsonl`, one `{"messages": [...]}` object per line (OpenAI's fine-tuning format); a malformed line is one
UserError naming FILE:LINE and what is wrong. A Hugging Face Hub dataset with a `messages` column (e.g.
HuggingFaceTB/smoltalk) is read with the `datasets` library (`load_hub`, `config.chat.data=hf:NAME[:SUBSET[:SPLIT]]`);
without a network the error names the local route: its rows saved as such a `.jsonl` file where the Hub is reachable.
Conversations to answer (`jaxgpt sample --chat --prompt_file`) are the same, ending with a user turn instead.

The chat format wraps every turn in special tokens that are added to the run's tokenizer
(`jaxgpt.data.tokenizer.WithSpecialTokens`):

    <|system|>You answer briefly.<|end|><|user|>What is 2 + 3?<|end|><|assistant|>5<|end|>

The system message is a turn of its own at the start (the format's place for it); a reply is prompted by
`<|assistant|>` and ends at `<|end|>`, the stop token. The same format is written as a Hugging Face-style Jinja2
chat template (`CHAT_TEMPLATE`, saved as `chat_template.jinja` in the run), which `jaxgpt serve` renders to text
and encodes with the run's tokenizer; `encode_conversation` builds the same ids message by message so that it
also knows which tokens are the assistant's (the loss mask), and tests check the two agree. `load_template` reads
a run's template back, or the file `--chat_template` gives instead.

Built-in conversations (`builtin_conversations`) need no download: a seeded generator of four small datasets
(`BUILTIN_DATASETS`: adding or subtracting numbers, spelling a random string backwards, counting a letter in one,
a fact about a random name from the system message) with one checkable answer each: held-out prompts test the
skill, not recall of training data.
"""

from __future__ import annotations

import bisect
import dataclasses
import datetime
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar, NoReturn

import numpy as np

from jaxgpt import storage
from jaxgpt.data.batches import held_out_split
from jaxgpt.data.hub import hub_rows
from jaxgpt.data.streams import BUILTIN_STREAM
from jaxgpt.data.tokenizer import Tokenizer, WithSpecialTokens
from jaxgpt.data.user_files import jsonl_objects
from jaxgpt.errors import UserError

Message = dict[str, str]
Conversation = list[Message]

ROLES = ("system", "user", "assistant")
END = "<|end|>"
ROLE_TOKENS = {role: f"<|{role}|>" for role in ROLES}
SPECIAL_TOKENS = (*ROLE_TOKENS.values(), END)
# The format as a Jinja2 chat template (variables: messages, add_generation_prompt; bos_token and eos_token are
# not needed, the special tokens are spelled out). One line: trim_blocks/lstrip_blocks then change nothing.
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
TEMPLATE_FILE = "chat_template.jinja"  # a run's own template, in its workdir (saved by task chat, read by serve)
BUILTIN_DATASETS = ("arithmetic", "reverse", "count", "fact")


def mean_by_kind(kinds: np.ndarray, values: np.ndarray) -> dict[str, float]:
    """The mean of `values` over the examples of each kind (a built-in dataset's name, or a file's one kind), in
    name order: the per-dataset scores every chat-shaped task reports beside its overall one."""
    return {kind: float(np.mean(values[kinds == kind])) for kind in sorted(set(kinds.tolist()))}


def by_kind_text(scores: dict[str, float]) -> str:
    """`mean_by_kind`'s scores as runs print them, and the benchmarks' tables: "arithmetic 0.52, count 0.31"."""
    return ", ".join(f"{kind} {score:.2f}" for kind, score in scores.items())


@dataclasses.dataclass(frozen=True)
class Conversations:
    """Which conversations a run reads: the settings config.chat (a chat run's data) and config.rl (an RL run's
    prompts) share (jaxgpt.train.config); `group` names the config group in errors."""

    group: ClassVar[str]
    # "builtin" (seeded conversations with checkable answers), a .jsonl of {"messages": [...]}, or a Hugging Face Hub
    # dataset with a messages column, "hf:NAME[:SUBSET[:SPLIT]]" (needs `datasets`; `load_hub`)
    data: str = "builtin"
    datasets: str = ",".join(BUILTIN_DATASETS)  # "builtin": which built-in datasets, comma-separated
    examples: int = 20000  # "builtin": conversations generated (train + held-out)
    val_fraction: float = 0.05  # conversations held out (by a hash of the prompt) for loss and exact match

    def __post_init__(self) -> None:
        if not 0.0 < self.val_fraction < 1.0:
            raise UserError(f"config.{self.group}.val_fraction={self.val_fraction} must be between 0 and 1 "
                            "(exclusive), e.g. 0.05")
        if self.examples < 2:
            raise UserError(f"config.{self.group}.examples={self.examples} must be >= 2")


def _refuse(message: str) -> NoReturn:
    raise UserError(f"the chat template refused the conversation: {message}")


class ChatTemplate:
    """A Hugging Face-format Jinja2 chat template, compiled once; `render` is safe to call from any thread.

    It sees `messages`, `add_generation_prompt`, `bos_token`, `eos_token` and any other special token's text given
    (`tokens`: unk_token, pad_token), `tools` and `documents` (None), and may call `raise_exception(message)` and
    `strftime_now(format)`; it renders in jinja2's sandbox with trim_blocks, lstrip_blocks and loop controls
    (break, continue), and `tojson` keeps non-ASCII text, as transformers renders `apply_chat_template`, so a
    template (Llama's, Qwen's, Gemma's) renders the same text in both. It lives beside the chat format so that the
    format's own template (CHAT_TEMPLATE) and any other render through one code path, for `jaxgpt serve` and for
    the tests that check `encode_conversation` against it."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", **tokens: str) -> None:
        import jinja2  # an extra (serve, test): training on conversations never renders a template
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token
        self.tokens = {**tokens, "bos_token": bos_token, "eos_token": eos_token}
        self._errors = jinja2.TemplateError
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _refuse
        env.globals["strftime_now"] = lambda format: datetime.datetime.now().strftime(format)
        env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise UserError(f"the chat template does not parse (line {e.lineno}): {e.message}") from None

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages`; a UserError when the template fails on them."""
        try:
            return self.template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                        tools=None, documents=None, **self.tokens)
        except self._errors as e:
            raise UserError(f"the chat template failed on these messages: {e}") from None


def load_template(workdir: str | os.PathLike[str] | None, override: str | os.PathLike[str] | None
                  ) -> str | None:
    """The template text of `override` (a file: `--chat_template`), else the run's `chat_template.jinja` (in its
    workdir, a local directory or a bucket), else None (no chat)."""
    if override is not None:
        path = storage.location(override, "--chat_template")
    elif workdir is not None:
        path = storage.location(workdir, "--workdir") / TEMPLATE_FILE
        with storage.guard(path, "looking for the run's chat template"):
            if not path.exists():
                return None
    else:
        return None
    with storage.guard(path, "reading the chat template"):
        if not path.exists():
            raise UserError(f"--chat_template={override}: no such file")
        return path.read_text(encoding="utf-8")


def chat_tokenizer(base: Tokenizer) -> WithSpecialTokens:
    """`base` with the chat format's special tokens; a tokenizer that already has exactly them is kept."""
    if isinstance(base, WithSpecialTokens):
        if base.specials != list(SPECIAL_TOKENS):
            raise UserError(f"the weights' tokenizer has special tokens {base.specials}, not the chat format's "
                            f"{list(SPECIAL_TOKENS)}: fine-tune from a base model or a jaxgpt chat run")
        return base
    return WithSpecialTokens(base, SPECIAL_TOKENS)


def conversation_error(obj: object, prompt: bool = False) -> str | None:
    """What is wrong with one parsed line (`{"messages": [...]}`), or None when it is a valid conversation: one
    to learn from, ending with the assistant's turn, or with `prompt` one to answer, ending with the user's."""
    messages = obj.get("messages") if isinstance(obj, dict) else None
    if not isinstance(messages, list) or not messages:
        return 'expected an object with a non-empty "messages" list'
    expected = "user"
    for i, m in enumerate(messages, 1):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            return f'message {i} is not an object with a string "content"'
        role = m.get("role")
        if role not in ROLES:
            return f"message {i} has unknown role {role!r} (roles: {', '.join(ROLES)})"
        if i == 1 and role == "system" and len(messages) > 1:
            continue
        if role != expected:
            return (f"turns out of order: message {i} is {role!r} where {expected!r} was expected (an optional system "
                    "message, then user and assistant turns alternating from user)")
        expected = "assistant" if role == "user" else "user"
    if any(special in m["content"] for m in messages for special in SPECIAL_TOKENS):
        return f"a message contains a special token of the chat format ({', '.join(SPECIAL_TOKENS)})"
    if prompt:
        return None if messages[-1]["role"] == "user" else "the last turn is not the user's (nothing to answer)"
    if not any(m["role"] == "assistant" for m in messages):
        return "no assistant turn"
    if messages[-1]["role"] != "assistant":
        return "the last turn is not the assistant's (nothing to learn from it)"
    return None


def load_jsonl(path: str | Path, prompt: bool = False) -> list[tuple[str, Conversation]]:
    """("FILE:LINE", conversation) of every conversation of a .jsonl file (blank lines skipped); the first bad line
    is a UserError FILE:LINE. `prompt`: conversations to answer (see `conversation_error`)."""
    conversations = []
    for where, obj in jsonl_objects(path):
        if (error := conversation_error(obj, prompt)) is not None:
            raise UserError(f"{where}: {error}")
        conversations.append((where, [{"role": m["role"], "content": m["content"]} for m in obj["messages"]]))
    if not conversations:
        raise UserError(f"{path} holds no conversations: give one JSON object per line, "
                        '{"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]}')
    return conversations


def hub_conversations(rows: Iterable[dict[str, Any]], where: str) -> list[tuple[int, Conversation]]:
    """(row number, conversation) of each row's `messages` (a `datasets.Dataset` iterates as such dicts); the
    first bad row is a UserError WHERE row N."""
    conversations = []
    for n, row in enumerate(rows):
        if (error := conversation_error(row)) is not None:
            raise UserError(f"{where} row {n}: {error}")
        conversations.append((n, [{"role": m["role"], "content": m["content"]} for m in row["messages"]]))
    if not conversations:
        raise UserError(f"{where} has no rows")
    return conversations


def load_hub(spec: str, key: str) -> list[tuple[int, Conversation]]:
    """The conversations of a Hub dataset `hf:NAME[:SUBSET[:SPLIT]]`, config `key`'s value (`hub_rows`: offline, or
    without `datasets`, one UserError naming the local-file route)."""
    rows = hub_rows(spec, key, ("messages",), "OpenAI-format conversations", "chat.jsonl")
    return hub_conversations(rows, spec)


@dataclasses.dataclass(frozen=True)
class Encoded:
    """One conversation as ids with, per token, whether the model is trained to produce it."""

    ids: np.ndarray  # (L,) int32
    assistant: np.ndarray  # (L,) bool: the assistant's content and its end token
    answer: np.ndarray  # (L,) bool: the same, for the last assistant turn only (what exact match checks)
    turn_ends: tuple[int, ...]  # the length after each assistant turn: where the conversation may be cut


def encode_conversation(tokenizer: WithSpecialTokens, messages: Conversation) -> Encoded:
    """Ids of `messages` in the chat format, equal to encoding CHAT_TEMPLATE's rendering (no generation prompt)."""
    end_id = tokenizer.special_ids[END]
    ids = list(tokenizer.prefix)
    assistant = [False] * len(ids)
    turn_ends = []
    for m in messages:
        content = tokenizer.encode_continuation(m["content"])
        ids += [tokenizer.special_ids[ROLE_TOKENS[m["role"]]], *content, end_id]
        mine = m["role"] == "assistant"
        assistant += [False] + [mine] * (len(content) + 1)
        if mine:
            turn_ends.append(len(ids))
    assistant_L = np.array(assistant, bool)
    answer_L = assistant_L & (np.arange(len(ids)) >= turn_ends[-1] - len(content) - 1)
    return Encoded(np.array(ids, np.int32), assistant_L, answer_L, tuple(turn_ends))


def fit_context(encoded: Encoded, max_tokens: int) -> Encoded | None:
    """`encoded` cut after its last assistant turn that ends within `max_tokens`, or None when none does."""
    if len(encoded.ids) <= max_tokens:
        return encoded
    ends = [e for e in encoded.turn_ends if e <= max_tokens]
    if not ends:
        return None
    n = ends[-1]
    start = ends[-2] if len(ends) > 1 else 0  # the last kept assistant turn lies between the previous end and n
    answer = encoded.assistant[:n] & (np.arange(n) >= start)
    return Encoded(encoded.ids[:n], encoded.assistant[:n], answer, tuple(ends))


def pack_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """The conversations each row holds (indices into `lengths`, each `capacity` ids at most), best-fit decreasing:
    the longest first, each into the open row it leaves the least room in (the earliest of equals), else a new one.

    Long conversations take rows first and the short ones fill their gaps, which leaves less padding than placing
    them in a shuffled order. A pure function of the lengths: the rows, and with them the batch of every step
    (`batch_indices` over the rows), are fixed by the data, so a resumed run sees the same batches.
    """
    rows: list[list[int]] = []
    open_rows: list[tuple[int, int]] = []  # (room left, row), sorted: the best fit is the first with room enough
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        k = bisect.bisect_left(open_rows, (lengths[i], 0))
        if k < len(open_rows):
            room, row = open_rows.pop(k)
        else:
            room, row = capacity, len(rows)
            rows.append([])
        rows[row].append(i)
        if room > lengths[i]:
            bisect.insort(open_rows, (room - lengths[i], row))
    return rows


def to_rows(encoded: Sequence[Encoded], width: int, rows: Sequence[Sequence[int]] | None = None
            ) -> dict[str, np.ndarray]:
    """Rows of `width` + 1 ids, one conversation each or those `rows` lists (`pack_rows`) one after another, then
    padding: inputs x, targets y, the loss masks of the targets, and the segment of each input (1, 2, ... for the
    row's conversations in turn, 0 for padding), which keeps packed conversations apart (`GPT.hidden`). Padding
    follows the conversations, so causal attention never lets a real token see it."""
    rows = [[i] for i in range(len(encoded))] if rows is None else rows
    ids_NW, segments_NW = (np.zeros((len(rows), width + 1), np.int32) for _ in range(2))
    assistant_NW, answer_NW = (np.zeros((len(rows), width + 1), np.float32) for _ in range(2))
    for n, row in enumerate(rows):
        start = 0
        for segment, i in enumerate(row, 1):
            e, end = encoded[i], start + len(encoded[i].ids)
            ids_NW[n, start:end], assistant_NW[n, start:end], answer_NW[n, start:end] = e.ids, e.assistant, e.answer
            segments_NW[n, start:end], start = segment, end
    return {"x": ids_NW[:, :-1], "y": ids_NW[:, 1:], "loss_mask": assistant_NW[:, 1:], "answer_mask": answer_NW[:, 1:],
            "segments": segments_NW[:, :-1]}


def prompt_key(prompt: list[Message]) -> bytes:
    """What SFT, RL and DPO hold out by (`batches.held_out_split`'s key): a prompt's messages, so that a prompt is
    held out by all three or by none, and a prompt repeated in the data is on one side only."""
    return json.dumps(prompt, sort_keys=True).encode()


def split_held_out(conversations: list[Conversation], val_fraction: float) -> tuple[list, list]:
    """(train, val), held out by prompt (everything before the last assistant turn, `prompt_key`)."""
    return held_out_split(conversations, lambda c: prompt_key(c[:-1]), val_fraction, "conversations",
                          "config.chat.val_fraction")


# ----------------------------------------------------------------------------------------------------
# Built-in conversations

LETTERS = "abcdefghijklmnopqrstuvwxyz"
ATTRIBUTES = ("code", "pet", "city", "lucky number")  # a fact's value: a random word, or a number for the last
# Operands of the arithmetic task. Held-out conversations are split by prompt (`split_held_out`), so a held-out
# sum or difference is a pair of operands never seen in training: the task tests carrying digits, not recall.
# 0 to 49 make 3,775 distinct questions, of which the default val_fraction (0.05) holds out about 190: one is 0.006
# of pass@1 (with 0 to 19, 610 questions, it held out 30, and one was 0.033, coarser than a change of 0.02 can be read).
MAX_OPERAND = 49


def _word(rng: np.random.Generator, low: int = 3, high: int = 6) -> str:
    """A random string of `low`..`high` lowercase letters: with 26**3 or more of each length, a held-out string
    is almost never a training string, so a held-out answer cannot be recalled, only worked out."""
    return "".join(LETTERS[i] for i in rng.integers(len(LETTERS), size=int(rng.integers(low, high + 1))))


def _arithmetic(rng: np.random.Generator) -> Conversation:
    a, b = (int(v) for v in rng.integers(0, MAX_OPERAND + 1, 2))
    if rng.random() < 0.5:
        op, answer = "+", a + b
    else:
        a, b = max(a, b), min(a, b)
        op, answer = "-", a - b
    return [{"role": "user", "content": f"What is {a} {op} {b}?"}, {"role": "assistant", "content": str(answer)}]


def _reverse(rng: np.random.Generator) -> Conversation:
    word = _word(rng)
    return [{"role": "user", "content": f"Spell '{word}' backwards."}, {"role": "assistant", "content": word[::-1]}]


def _count(rng: np.random.Generator) -> Conversation:
    """A letter placed 0 to 3 times in a random string of other letters, each count equally likely: with the
    letter drawn from the string instead, most answers are 1, and a model that always says 1 scores well.

    The answer counts aloud: each letter of the string with the count so far, then the total ("q0 w0 x1 r1 x2:
    2"). Every token of it is then a copy, a comparison with the asked letter, or an increment of the digit just
    written, steps a small model learns; asked for the bare total, the quick-start model stayed at chance
    (docs/chat.md), since the total needs every position at once."""
    letter = LETTERS[int(rng.integers(len(LETTERS)))]
    others = LETTERS.replace(letter, "")
    chars = [others[i] for i in rng.integers(len(others), size=int(rng.integers(3, 7)))]
    for position in rng.choice(len(chars), size=min(int(rng.integers(4)), len(chars)), replace=False):
        chars[position] = letter
    word = "".join(chars)
    tally = " ".join(f"{c}{word[:i + 1].count(letter)}" for i, c in enumerate(word))
    return [{"role": "user", "content": f"How many times does the letter '{letter}' appear in '{word}'?"},
            {"role": "assistant", "content": f"{tally}: {word.count(letter)}"}]


def _fact(rng: np.random.Generator) -> Conversation:
    """A random name and value, so the answer can only come from the system message, never from memory."""
    name, attribute = _word(rng).capitalize(), ATTRIBUTES[int(rng.integers(len(ATTRIBUTES)))]
    value = str(int(rng.integers(10, 100))) if attribute == "lucky number" else _word(rng)
    return [{"role": "system", "content": f"{name}'s {attribute} is {value}."},
            {"role": "user", "content": f"What is {name}'s {attribute}?"},
            {"role": "assistant", "content": value}]


_GENERATORS = {"arithmetic": _arithmetic, "reverse": _reverse, "count": _count, "fact": _fact}


def builtin_conversations(seed: int, n: int, datasets: Sequence[str] = BUILTIN_DATASETS) -> list[Conversation]:
    """`n` conversations, from each of `datasets` in turn (a pure function of (seed, n, datasets)); each has one
    right answer, its assistant turn. Training batches are shuffled (`batch_indices`), so the order does not matter."""
    unknown = [t for t in datasets if t not in _GENERATORS]
    if unknown or not datasets:
        raise UserError(f"config.chat.datasets (config.rl.datasets for RL): unknown built-in dataset(s) {unknown}: "
                        f"choose from {', '.join(BUILTIN_DATASETS)}")
    rng = np.random.Generator(np.random.PCG64([seed, BUILTIN_STREAM]))
    return [_GENERATORS[datasets[i % len(datasets)]](rng) for i in range(n)]
