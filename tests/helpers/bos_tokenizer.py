"""A tiny Llama-3-style tokenizer (needs `tokenizers`): byte-level BPE whose post-processor puts
<|begin_of_text|> before every text, with <|eot_id|> ending a turn and a Llama-3-like chat template, as a
`JsonTokenizer` (`add_bos`) and as the `ModelChat` a chat run of such a model uses."""

from __future__ import annotations

from helpers.tiny_llama import byte_level_bpe
from jaxgpt.data.model_chat import ModelChat
from jaxgpt.data.tokenizer_json import JsonTokenizer

BOS, EOT, END = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
            "{{ m['content'] }}<|eot_id|>{% endfor %}"
            "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
TEXTS = ["What is 2 + 3? It is 5.", "the answer is 42", "Spell 'abc' backwards: cba.", "hello world " * 3]


def bos_tokenizer() -> JsonTokenizer:
    """The tokenizer, with BOS id 0 put before each whole text."""
    import tokenizers

    backend = byte_level_bpe(TEXTS * 3, [BOS, EOT, END, "<|start_header_id|>", "<|end_header_id|>"], 320)
    backend.post_processor = tokenizers.processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    return JsonTokenizer(backend.to_str(), bos_token=0, add_bos=True, eot_token=1, stop_ids=[1, 2],
                         tokens={"bos_token": BOS, "eos_token": EOT})


def bos_chat() -> ModelChat:
    """The tokenizer with its template, replies ending at <|eot_id|> (id 2)."""
    tokenizer = bos_tokenizer()
    return ModelChat(tokenizer, {"template": TEMPLATE, "end_id": 2, "stop_ids": [1, 2], "tokens": tokenizer.tokens})
