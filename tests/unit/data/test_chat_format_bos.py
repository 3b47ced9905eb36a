"""jaxgpt's own chat format (for a model without a chat template of its own) on a tokenizer that puts a BOS before
each whole text, as Llama 3's does: one BOS starts a conversation, none before each of its messages."""

from __future__ import annotations

import pytest
from helpers.chat import render

from jaxgpt.data.conversations import chat_tokenizer, encode_conversation
from jaxgpt.data.model_chat import chat_prompt_ids

pytest.importorskip("tokenizers")
CONVERSATION = [{"role": "system", "content": "the answer is 42"}, {"role": "user", "content": "What is 2 + 3?"},
                {"role": "assistant", "content": "It is 5."}]


@pytest.fixture(scope="module")
def tok():
    from helpers.bos_tokenizer import bos_tokenizer

    return chat_tokenizer(bos_tokenizer())


def test_a_conversation_starts_with_one_bos_and_equals_its_rendered_text(tok) -> None:
    enc = encode_conversation(tok, CONVERSATION)
    ids = enc.ids.tolist()
    assert tok.prefix == [0] and ids[0] == 0 and ids.count(0) == 1
    assert ids == tok.encode(render(CONVERSATION))
    assert not enc.assistant[0]
    assert tok.decode(ids[1:]) == render(CONVERSATION)


def test_a_prompt_starts_with_one_bos_and_a_text_already_starting_with_it_gets_no_second(tok) -> None:
    prompt = chat_prompt_ids(tok, CONVERSATION[:2])
    assert prompt == tok.encode(render(CONVERSATION[:2], add_generation_prompt=True))
    assert prompt.count(0) == 1 and prompt[0] == 0
    assert tok.encode(tok.decode(prompt)) == prompt  # the BOS's own text is that token, not a second one
    assert tok.encode_continuation("It is 5.") == tok.base.encode_continuation("It is 5.")
