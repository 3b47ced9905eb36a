"""Tiny tokenizers that put a BOS before every text (need `tokenizers`), as `JsonTokenizer`s (`add_bos`): Llama 3's
kind, byte-level BPE with <|begin_of_text|>, <|eot_id|> ending a turn and a Llama-3-like chat template (also as the
`ModelChat` a chat run of such a model uses); and Llama 2's, SentencePiece-style BPE whose words start with "▁",
unknown characters falling back to byte tokens <0xNN>, decoded with the first space stripped."""

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


def sentencepiece_tokenizer() -> JsonTokenizer:
    """Llama 2's tokenizer.json layout: a normalizer writing spaces as "▁" with one before the text, BPE with byte
    fallback, and a decoder that turns "▁" back into spaces, bytes into characters and strips the leading space."""
    import tokenizers
    from tokenizers import decoders, normalizers

    backend = tokenizers.Tokenizer(tokenizers.models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256))]
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=320, special_tokens=specials,
                                             initial_alphabet=list("abcdefghijklmnopqrstuvwxyz\u2581"))
    backend.train_from_iterator(TEXTS * 3 + ["hello world and the world says hello", "  two spaces  here "], trainer)
    return JsonTokenizer(backend.to_str(), bos_token=1, add_bos=True, eot_token=2, stop_ids=[2],
                         tokens={"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
