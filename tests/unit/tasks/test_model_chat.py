"""Chat fine-tuning from a model with its own chat template (a tiny random Llama directory made by transformers):
the model's tokenizer and template, nothing added to its vocabulary, the loss on the assistant turns exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers.tiny_llama import PADDED, TEMPLATE, save_tiny_llama

from jaxgpt.data.conversations import TEMPLATE_FILE
from jaxgpt.data.model_chat import ModelChat, chat_prompt_ids, encode_chat
from jaxgpt.errors import UserError
from jaxgpt.tasks.chat import Chat
from jaxgpt.train.config import base_config, from_config_dict

pytest.importorskip("transformers")
pytestmark = pytest.mark.torch
CONVERSATION = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "It is 5."},
                {"role": "user", "content": "Spell 'abc' backwards."}, {"role": "assistant", "content": "cba"}]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_llama")
    model, tokenizer = save_tiny_llama(root)
    return root, model, tokenizer


def _task(root, tmp_path, **chat) -> Chat:
    c = base_config()
    c.task, c.init_from, c.workdir, c.batch_size = "chat", f"hf:{root}", str(tmp_path / "run"), 2
    c.model.block_size = 128
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps({"messages": CONVERSATION[:2 + 2 * (i % 2)]}) for i in range(8)))
    c.chat.data, c.chat.val_fraction = str(path), 0.25
    for k, v in chat.items():
        setattr(c.chat, k, v)
    return Chat(from_config_dict(c))


def test_targets_are_the_assistant_turns_through_their_end_token(llama, tmp_path):
    root, _, theirs = llama
    task = _task(root, tmp_path)
    tokenizer = task.tokenizer
    assert isinstance(tokenizer, ModelChat) and tokenizer.decode([tokenizer.end_id]) == "<|im_end|>"
    encoded = encode_chat(tokenizer, CONVERSATION)
    # the ids are transformers' apply_chat_template's; the targets are each reply and its <|im_end|>, nothing else
    assert encoded.ids.tolist() == list(theirs.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)[
        "input_ids"])
    runs = np.split(np.flatnonzero(encoded.assistant), np.flatnonzero(np.diff(np.flatnonzero(encoded.assistant)) > 1)
                    + 1)
    assert [tokenizer.decode(encoded.ids[r]) for r in runs] == ["It is 5.<|im_end|>", "cba<|im_end|>"]
    assert tokenizer.decode(encoded.ids[encoded.answer]) == "cba<|im_end|>"
    # a reply follows exactly the ids a server prompts with (the template's generation prompt)
    prompt = chat_prompt_ids(tokenizer, CONVERSATION[:3])
    assert prompt == theirs.apply_chat_template(CONVERSATION[:3], add_generation_prompt=True, tokenize=True,
                                                return_dict=True)["input_ids"]
    assert encoded.ids[:len(prompt)].tolist() == prompt and encoded.assistant[len(prompt)]
    assert encoded.turn_ends[-1] == runs[-1][-1] + 1


def test_the_run_keeps_the_model_vocabulary_template_and_stop_ids(llama, tmp_path):
    root, model, _ = llama
    task = _task(root, tmp_path, pack=True)
    assert task.model_cfg.vocab_size == model.config.vocab_size == task.tokenizer.vocab_size + PADDED  # no growth
    assert task.meta["chat"]["template"] == TEMPLATE == task.run_files[TEMPLATE_FILE]
    assert task.meta["chat"]["end_id"] == 2 and task.meta["chat"]["stop_ids"] == [2, 0]
    assert "special_tokens" not in task.meta["chat"] and "no tokens added" in task.describe()
    # the loss mask of every training row is the assistant turns' tokens: each masked target decodes into a reply
    x, y, mask = task.train["x"], task.train["y"], task.train["loss_mask"]
    replies = {*task.tokenizer.encode("It is 5."), *task.tokenizer.encode("cba"), 2}
    assert mask.sum() > 0 and set(y[mask > 0].tolist()) <= replies
    assert x.shape == y.shape


def test_a_template_that_rewrites_earlier_turns_is_one_line(llama):
    root, _, _ = llama
    from jaxgpt.data.tokenizer_json import read_json_tokenizer
    base = read_json_tokenizer(root)
    rewriting = TEMPLATE.replace("message['content']", "(message['content'] if loop.last else '...')")
    chat = ModelChat(base, {"template": rewriting, "end_id": 2, "stop_ids": [2], "tokens": base.tokens})
    with pytest.raises(UserError, match=r"renders message 2 .* differently") as info:
        encode_chat(chat, CONVERSATION)
    assert "\n" not in str(info.value)


def test_rl_prompts_with_the_models_generation_prompt_and_stops_at_its_end(llama, tmp_path):
    from jaxgpt.tasks.rl.task import RL

    root, _, theirs = llama
    c = base_config()
    c.task, c.init_from, c.workdir, c.batch_size = "rl", f"hf:{root}", str(tmp_path / "run"), 4
    c.model.block_size = 128
    c.rl.examples, c.rl.datasets, c.rl.num_generations = 40, "arithmetic", 2
    task = RL(from_config_dict(c))
    assert task.end_id == 2 and task.model_cfg.vocab_size == task.tokenizer.vocab_size + PADDED
    assert task.meta["chat"]["template"] == TEMPLATE == task.run_files[TEMPLATE_FILE]
    prompt = task.train.prompts[0]
    assert task.train.ids[0] == theirs.apply_chat_template(prompt.messages, add_generation_prompt=True,
                                                           tokenize=True, return_dict=True)["input_ids"]
