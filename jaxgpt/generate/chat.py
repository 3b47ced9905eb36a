"""Replies of a chat model (a run of task chat): a conversation rendered with the run's chat template, then sampled
until the chat format's end token, streamed for a terminal (`jaxgpt sample --chat`) or many at once.

A reply gets at most the context the conversation leaves (block_size less the prompt), as `jaxgpt serve` gives a
chat request without max_tokens, so the sampled text never slides past the start of the conversation and a
greedy reply here is the server's greedy reply. Replies are decoded as they stream by `text_stream.StreamDecoder`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TextIO

from jaxgpt.data.conversations import ChatTemplate, Conversation, conversation_error
from jaxgpt.data.tokenizer import Tokenizer
from jaxgpt.errors import UserError, optional_import
from jaxgpt.generate import sampling
from jaxgpt.generate.many import generate_many
from jaxgpt.generate.text_stream import StreamDecoder, until_eot
from jaxgpt.model.config import ModelConfig

NEW, SYSTEM = "/new", "/system "  # the terminal's commands: forget the conversation; start one with a system message


@dataclasses.dataclass(frozen=True)
class ChatModel:
    """A GPT fine-tuned on conversations, its tokenizer, its chat template and the end token a reply stops at."""

    params: Any
    cfg: ModelConfig
    tokenizer: Tokenizer
    template: ChatTemplate
    end_id: int

    @classmethod
    def from_run(cls, params: Any, cfg: ModelConfig, tokenizer: Tokenizer, meta: dict[str, Any],
                 template: str | None) -> ChatModel:
        """A chat run's model (its checkpoint's `meta["chat"]` has the end token), with `template`, else the one
        the run was trained with; any other model is a UserError saying how to make one."""
        chat = meta.get("chat")
        if chat is None:
            raise UserError("this model has no chat template: chat needs a run fine-tuned on conversations, e.g. "
                            "python train.py --config configs/chat_sft.py --config.init_from=workdir:RUN "
                            "(docs/chat.md: Supervised fine-tuning)")
        optional_import("jinja2", "chatting", package="jinja2")
        return cls(params, cfg, tokenizer, ChatTemplate(template or chat["template"], **chat.get("tokens", {})),
                   chat["end_id"])

    def prompt(self, messages: Conversation, where: str = "the conversation") -> tuple[list[int], int]:
        """The ids the model continues (the template's generation prompt after the turns), and how many new tokens
        fit after them in the context; a UserError naming `where` when none does."""
        ids = self.tokenizer.encode(self.template.render(messages, add_generation_prompt=True))
        room = self.cfg.block_size - len(ids)
        if room < 1:
            raise UserError(f"{where} is {len(ids)} tokens, which fills the model's context of {self.cfg.block_size}: "
                            "shorten it, or start a new conversation")
        return ids, room

    def stream(self, messages: Conversation, *, max_new_tokens: int, **options: Any) -> Iterator[str]:
        """The reply's text piece by piece as it is sampled, without the end token; `options` go to
        `sampling.stream` (key, temperature, top_k, top_p, chunk_size, dtype)."""
        ids, room = self.prompt(messages)
        out = StreamDecoder(self.tokenizer)
        for chunk_BN in sampling.stream(self.params, self.cfg, ids, max_new_tokens=min(max_new_tokens, room),
                                        eot_token=self.end_id, vocab_limit=self.tokenizer.vocab_size, **options):
            new = [int(i) for i in chunk_BN[0]]
            if self.end_id in new:
                yield out.push(new[:new.index(self.end_id)], final=True)
                return
            yield out.push(new)
        yield out.push([], final=True)

    def replies(self, conversations: Sequence[tuple[str, Conversation]], *, max_new_tokens: int, seed: int,
                temperature: float, top_p: float, slots: int) -> list[str]:
        """The reply to each (where, conversation), `slots` at a time through the continuous-batching engine; each
        is what `stream` samples for it alone with key `seed`."""
        prompts = [self.prompt(messages, where) for where, messages in conversations]
        outputs = generate_many(self.params, self.cfg, [ids for ids, _ in prompts],
                                max_new_tokens=[min(max_new_tokens, room) for _, room in prompts], seeds=seed,
                                temperature=temperature, top_p=top_p, eot_token=self.end_id,
                                vocab_limit=self.tokenizer.vocab_size, slots=slots, progress=True)
        return [self.tokenizer.decode(until_eot(ids, self.end_id)) for ids in outputs]


def converse(model: ChatModel, lines: Iterable[str], out: TextIO, err: TextIO, ask: str = "",
             **options: Any) -> None:
    """A chat on a terminal: each line is a user turn, answered as it is sampled (with the sampling `options` of
    `ChatModel.stream`, line k with key `seed` + k); "/new" forgets the conversation and "/system TEXT" starts
    one with that system message. A turn that cannot be answered (too long for the context) is one line on `err`
    and left out, so the session goes on. `ask` is written before each line is read (a terminal's prompt)."""
    seed = options.pop("seed", 0)
    messages: Conversation = []
    out.write(ask)
    out.flush()
    for turn, line in enumerate(lines):
        text = line.rstrip("\r\n")
        if text.strip() == NEW:
            messages = []
        elif text.startswith(SYSTEM):
            messages = [{"role": "system", "content": text.removeprefix(SYSTEM).strip()}]
        elif text.strip():
            messages.append({"role": "user", "content": text})
            try:  # (the model's own replies may hold special tokens: only the new turn is checked)
                if (error := conversation_error({"messages": messages[-1:]}, prompt=True)) is not None:
                    raise UserError(error)
                reply = ""
                for piece in model.stream(messages, key=seed + turn, **options):
                    reply += piece
                    out.write(piece)
                    out.flush()
                out.write("\n")
                messages.append({"role": "assistant", "content": reply})
            except UserError as e:
                messages.pop()
                err.write(f"error: {e}\n")
                err.flush()
        out.write(ask)
        out.flush()
