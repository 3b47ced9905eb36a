"""Chat fine-tuning in a model's own chat format: its tokenizer, its chat template, its end-of-turn token.

A model that comes with a chat template (a Hugging Face directory's or a GGUF file's: Llama 3, Qwen, Gemma,
SmolLM2, or a jaxgpt run fine-tuned from one) is fine-tuned in that format, with nothing added to its vocabulary:
a conversation is the template's rendering, encoded by the model's tokenizer, and the model learns the assistant
turns as the template writes them, each up to and including the end-of-turn token its replies stop at (Llama 3's
<|eot_id|>, Qwen's and SmolLM2's <|im_end|>, Gemma's <end_of_turn>). A model without a template gets jaxgpt's own
chat format instead (`jaxgpt.data.conversations`), whose special tokens are added to its tokenizer.

Where the assistant turns are, in the rendered text: templates are programs (a default system message, reasoning
blocks, role headers), so the spans are found by rendering, as TRL's prefix-based assistant masks do, not by
parsing. For the k-th assistant turn, `before` is the template's rendering of the messages before it with the
generation prompt (exactly the text a server prompts the model with), and `through` the rendering of the messages
up to and including it; the turn's text is `through[len(before):]`. Both must be prefixes of the whole
conversation's rendering (each turn renders the same whether or not later turns follow); a template for which they
are not is one line, not a silent mask over the wrong tokens. The rendering is encoded once, with each token's
character offset (`JsonTokenizer.encode_offsets`): the tokens that start inside a turn's text, up to its first
end-of-turn token, are the turn's targets. What follows the end token inside the span (a newline the template
writes after <|im_end|>) is not, since sampling stops at the end token. The same `before` text is what RL
rollouts and `jaxgpt serve` prompt with (`prompt_ids`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxgpt.data.conversations import (
    CHAT_TEMPLATE,
    END,
    SPECIAL_TOKENS,
    ChatTemplate,
    Conversation,
    Encoded,
    encode_conversation,
)
from jaxgpt.data.tokenizer import Tokenizer, WithSpecialTokens
from jaxgpt.data.tokenizer_json import JsonTokenizer
from jaxgpt.errors import UserError, optional_import

# What a chat run's meta["chat"] keeps of the model's chat (as `tokenizer_json.chat_meta` and `gguf_chat` give it)
CHAT_KEYS = ("template", "end_id", "stop_ids", "tokens")


class ModelChat(Tokenizer):
    """A model's tokenizer with its chat template and end-of-turn token: encodes conversations in the model's format.

    As a `Tokenizer` it is the model's own (`to_meta` is the JsonTokenizer's), so a run trained with it samples and
    serves with the plain tokenizer plus meta["chat"] (`chat_meta`)."""

    def __init__(self, tokenizer: JsonTokenizer, chat: dict[str, Any]) -> None:
        self.base, self.chat = tokenizer, {k: chat[k] for k in CHAT_KEYS if k in chat}
        self.name, self.vocab_size, self.eot_token = tokenizer.name, tokenizer.vocab_size, tokenizer.eot_token
        self.end_id = int(chat["end_id"])
        optional_import("jinja2", "fine-tuning in the model's chat format", package="jinja2")
        self.template = ChatTemplate(chat["template"], **chat.get("tokens", {}))

    def encode_array(self, text: str) -> np.ndarray:
        return self.base.encode_array(text)

    def encode_continuation(self, text: str) -> list[int]:
        return self.base.encode_continuation(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.base.decode(ids)

    def to_meta(self) -> dict[str, Any]:
        return self.base.to_meta()

    def prompt_ids(self, messages: Conversation) -> list[int]:
        """The ids a reply to `messages` follows: the template's rendering with the generation prompt."""
        return self.encode(self.template.render(messages, add_generation_prompt=True))

    def encode_conversation(self, messages: Conversation) -> Encoded:
        """`messages` (ending with an assistant turn) as the template renders them, with the assistant turns'
        tokens through their end-of-turn token marked (see the module docstring)."""
        full = self.template.render(messages, add_generation_prompt=False)
        ids_L, starts_L = self.base.encode_offsets(full)
        assistant_L = np.zeros(len(ids_L), bool)
        turns = []
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.template.render(messages[:k], add_generation_prompt=True)
            through = self.template.render(messages[:k + 1], add_generation_prompt=False)
            if not (through.startswith(before) and full.startswith(through)):
                raise UserError(f"the chat template renders message {k + 1} (an assistant turn) differently once "
                                "later messages follow, so its tokens cannot be found: fine-tune on conversations "
                                "with one assistant turn, or use a template that renders each turn the same")
            span = np.flatnonzero((starts_L >= len(before)) & (starts_L < len(through)))
            ends = span[ids_L[span] == self.end_id]
            span = span[span <= ends[0]] if ends.size else span
            if not span.size:
                raise UserError(f"the chat template writes nothing for assistant message {k + 1}: nothing to learn")
            assistant_L[span] = True
            turns.append(span)
        answer_L = np.zeros_like(assistant_L)
        answer_L[turns[-1]] = True
        return Encoded(ids_L.astype(np.int32), assistant_L, answer_L, tuple(int(t[-1]) + 1 for t in turns))


def encode_chat(tokenizer: Tokenizer, messages: Conversation) -> Encoded:
    """`messages` in the run's chat format: the model's own (`ModelChat`) or jaxgpt's (`WithSpecialTokens`)."""
    if isinstance(tokenizer, ModelChat):
        return tokenizer.encode_conversation(messages)
    if not isinstance(tokenizer, WithSpecialTokens):
        raise TypeError(f"a chat tokenizer is a ModelChat or WithSpecialTokens, not {type(tokenizer).__name__}")
    return encode_conversation(tokenizer, messages)


def chat_prompt_ids(tokenizer: Tokenizer, messages: Conversation) -> list[int]:
    """The ids a reply to `messages` (ending with a user turn) follows, in the run's chat format."""
    if isinstance(tokenizer, ModelChat):
        return tokenizer.prompt_ids(messages)
    # jaxgpt's format: the conversation with an empty reply, less that reply's end token
    return encode_chat(tokenizer, [*messages, {"role": "assistant", "content": ""}]).ids[:-1].tolist()


def chat_format(tokenizer: Tokenizer) -> dict[str, Any]:
    """The chat format's part of a chat run's meta["chat"] (what `jaxgpt sample --chat` and `jaxgpt serve` read):
    the template, the end-of-turn id a reply stops at and, for jaxgpt's format, its special tokens."""
    if isinstance(tokenizer, ModelChat):
        return dict(tokenizer.chat)
    assert isinstance(tokenizer, WithSpecialTokens)
    return {"special_tokens": list(SPECIAL_TOKENS), "end_token": END, "end_id": tokenizer.special_ids[END],
            "template": CHAT_TEMPLATE}


def describe_format(tokenizer: Tokenizer) -> str:
    """The chat format in a line of a run's description."""
    if isinstance(tokenizer, ModelChat):
        return (f"the model's {tokenizer.name} tokenizer and chat template (a reply ends at "
                f"{tokenizer.decode([tokenizer.end_id])!r}, id {tokenizer.end_id}; no tokens added)")
    return f"{tokenizer.name} tokenizer + {len(SPECIAL_TOKENS)} chat tokens {list(SPECIAL_TOKENS)}"
