"""`JsonTokenizer` (a Hugging Face tokenizer.json) and Hugging Face chat templates against transformers' own.

The tokenizer is a byte-level BPE trained here on a few lines (as Llama 3's, Qwen's and SmolLM's are byte-level),
with a BOS post-processor, chat special tokens and a Llama-3-like chat template using bos_token, a system
message, loop controls and raise_exception; transformers' `AutoTokenizer` loads the same directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxgpt.data.conversations import ChatTemplate
from jaxgpt.data.hf_tokenizer import save_generation_config, save_hf_tokenizer
from jaxgpt.data.tokenizer import tokenizer_from_meta
from jaxgpt.data.tokenizer_json import JsonTokenizer, chat_meta, read_json_tokenizer
from jaxgpt.errors import UserError

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
pytestmark = pytest.mark.torch

SPECIALS = ["<s>", "</s>", "<|start|>", "<|eot|>"]
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + "
    "message['role']) }}{% endif %}"
    "{% if loop.index0 > 20 %}{% break %}{% endif %}"
    "<|start|>{{ message['role'] }}\n{{ message['content'] | trim }}<|eot|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n{% endif %}")
TEXTS = ["Hello world", "  leading spaces\tand tabs\n\nnewlines  ", "digits 1234567 3.14159 and 2+2=4",
         "unicode: héllo wörld 日本語 🚀 ﬁ", "<|start|>user\nhi<|eot|>", "", " ", "a</s>b<s>c", "<s>starts with bos"]
CONVERSATION = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": " Hello! "}, {"role": "user", "content": "What is 2 + 3? ünï"}]


def one_line_error(fn, *args) -> str:
    with pytest.raises(UserError) as info:
        fn(*args)
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.fixture(scope="module")
def directory(tmp_path_factory) -> Path:
    """A tokenizer.json, tokenizer_config.json (with the template) and generation_config.json."""
    model = tokenizers.models.BPE()
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(TEXTS * 3 + ["the quick brown fox jumps over the lazy dog " * 5], trainer)
    backend.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    root = tmp_path_factory.mktemp("tokenizer")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                                chat_template=TEMPLATE, clean_up_tokenization_spaces=False)
    fast.save_pretrained(root)
    transformers.GenerationConfig(bos_token_id=0, eos_token_id=[1, 3]).save_pretrained(root)
    return root


def test_ids_equal_transformers(directory):
    ours, theirs = read_json_tokenizer(directory), transformers.AutoTokenizer.from_pretrained(directory)
    assert (ours.bos_token, ours.add_bos, ours.eot_token, ours.stop_ids) == (0, True, 1, [1, 3])
    for text in TEXTS:
        assert ours.encode(text) == theirs(text)["input_ids"] or text.startswith("<s>"), text
        assert ours.decode(ours.encode(text)) == ("" if text.startswith("<s>") else "<s>") + text
    assert ours.encode("<s>starts with bos")[:2] != [0, 0]  # a text that starts with BOS gets no second one


def test_meta_round_trip_keeps_everything(directory):
    ours = read_json_tokenizer(directory)
    again = tokenizer_from_meta(json.loads(json.dumps(ours.to_meta())))
    assert isinstance(again, JsonTokenizer) and again.to_meta() == ours.to_meta()
    assert [again.encode(t) for t in TEXTS] == [ours.encode(t) for t in TEXTS]


def test_a_vocabulary_bigger_than_the_model_is_one_line(directory):
    assert "more than the model's vocab_size=100" in one_line_error(read_json_tokenizer, directory, 100)
    assert read_json_tokenizer(directory, 512).vocab_size < 400  # a model padded past the tokenizer is fine


def test_chat_template_renders_as_apply_chat_template(directory):
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    chat = chat_meta(directory, read_json_tokenizer(directory).to_meta())
    assert chat["end_id"] == 3  # the stop token the template writes, <|eot|>, not </s>
    template = ChatTemplate(chat["template"], **chat["tokens"])
    for generation in (True, False):
        assert template.render(CONVERSATION, generation) == theirs.apply_chat_template(
            CONVERSATION, tokenize=False, add_generation_prompt=generation)
    ids = read_json_tokenizer(directory).encode(template.render(CONVERSATION))
    assert ids == theirs.apply_chat_template(CONVERSATION, add_generation_prompt=True, return_dict=True)["input_ids"]


def test_a_template_that_fails_is_one_line(directory):
    chat = chat_meta(directory, read_json_tokenizer(directory).to_meta())
    template = ChatTemplate(chat["template"], **chat["tokens"])
    assert "unknown role tool" in one_line_error(template.render, [{"role": "tool", "content": "x"}])
    with pytest.raises(UserError, match="does not parse"):
        ChatTemplate("{% for %}")


def test_export_loads_in_transformers_with_the_same_ids(directory, tmp_path):
    ours = read_json_tokenizer(directory)
    save_hf_tokenizer(ours, tmp_path, 64, chat_template=TEMPLATE)
    save_generation_config(ours, tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert [theirs(t)["input_ids"] for t in TEXTS[:-1]] == [ours.encode(t) for t in TEXTS[:-1]]
    assert theirs.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True) == ChatTemplate(
        TEMPLATE, **ours.tokens).render(CONVERSATION)
    again = read_json_tokenizer(tmp_path)
    assert again.to_meta() == {**ours.to_meta(), "json": again.json_text}
