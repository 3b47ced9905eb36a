"""The tokenizer and chat template inside a GGUF file, as a `tokenizer.json` run by `JsonTokenizer`.

A GGUF file stores a byte-level BPE tokenizer (`tokenizer.ggml.model` "gpt2", the kind Llama 3, Qwen and SmolLM
use) as metadata: the vocabulary spelled in GPT-2's byte alphabet (`tokens`), the merges ("Ġ t"), a type per
token (3: control, such as <|im_end|>; 4: user-defined), the special ids and `add_bos_token`. What it does not
store is how text is cut into pieces before the merges: `tokenizer.ggml.pre` names that pre-tokenizer, and
`PRE_TOKENIZERS` gives each name jaxgpt knows the regular expressions the model's own tokenizer uses (llama.cpp
keeps the same table). `tokenizer_json` writes the `tokenizers` library's JSON for it, so the ids are those of
the model's tokenizer.json, and the file's Jinja chat template (`tokenizer.chat_template`) makes it a chat model.
"""

from __future__ import annotations

import json
from typing import Any

from jaxgpt.data.tokenizer_json import JsonTokenizer
from jaxgpt.errors import UserError
from jaxgpt.io.gguf import GGUFFile

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types that are matched whole in text
# Llama 3's split: contractions, letters with one leading non-letter, numbers of up to 3 digits, punctuation runs,
# line breaks, spaces (Qwen2's is the same with single digits).
_WORDS = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{DIGITS}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_BYTES = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
_GPT2_BYTES = {**_BYTES, "use_regex": True}  # GPT-2's own split, built into the ByteLevel step


def _split(pattern: str) -> dict[str, Any]:
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}, _BYTES]}


PRE_TOKENIZERS = {  # tokenizer.ggml.pre -> the `tokenizers` pre-tokenizer
    "default": _GPT2_BYTES,
    "gpt-2": _GPT2_BYTES,
    "smollm": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, _GPT2_BYTES]},
    "llama-bpe": _split(_WORDS.replace("{DIGITS}", "{1,3}")),
    "llama3": _split(_WORDS.replace("{DIGITS}", "{1,3}")),
    "qwen2": _split(_WORDS.replace("{DIGITS}", "")),
}


def tokenizer_json(file: GGUFFile) -> str:
    """The `tokenizers` library's JSON of the file's byte-level BPE tokenizer."""
    kind = file.get("tokenizer.ggml.model", None)
    if kind != "gpt2":
        raise UserError(f"{file.path} has a {kind!r} tokenizer (tokenizer.ggml.model): jaxgpt reads GGUF's byte-level "
                        "BPE ('gpt2'); pass your own tokenizer or use the model's Hugging Face directory (hf:)")
    pre = file.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise UserError(f"{file.path}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not one jaxgpt knows "
                        f"(supported: {', '.join(PRE_TOKENIZERS)}): use the model's Hugging Face directory (hf:)")
    tokens = file.get("tokenizer.ggml.tokens")
    types = file.get("tokenizer.ggml.token_type", [1] * len(tokens))
    added = [{"id": i, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": kind == CONTROL}
             for i, (token, kind) in enumerate(zip(tokens, types, strict=True)) if kind in (CONTROL, USER_DEFINED)]
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
             "vocab": {token: i for i, token in enumerate(tokens)},
             "merges": [merge.split(" ", 1) for merge in file.get("tokenizer.ggml.merges")]}
    return json.dumps({"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
                       "normalizer": None, "pre_tokenizer": PRE_TOKENIZERS[pre], "post_processor": None,
                       "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                                   "use_regex": True}, "model": model}, ensure_ascii=False)


def gguf_tokenizer(file: GGUFFile, model_vocab: int) -> JsonTokenizer:
    """The file's tokenizer, with its BOS rule, end-of-text token and the special tokens a chat template sees."""
    tokens = file.get("tokenizer.ggml.tokens")
    if len(tokens) > model_vocab:
        raise UserError(f"{file.path} lists {len(tokens)} tokens, more than the model's {model_vocab} embedding "
                        "rows: the file is inconsistent")
    ids = {name: file.get(f"tokenizer.ggml.{key}_token_id", None)
           for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"),
                             ("pad_token", "padding"))}
    eos = ids["eos_token"]
    return JsonTokenizer(tokenizer_json(file), bos_token=ids["bos_token"],
                         add_bos=bool(file.get("tokenizer.ggml.add_bos_token", False)), eot_token=eos,
                         stop_ids=[] if eos is None else [eos],
                         tokens={name: tokens[i] for name, i in ids.items() if i is not None},
                         where=f"{file.path}'s tokenizer")


def gguf_chat(file: GGUFFile, tokenizer: JsonTokenizer) -> dict[str, Any] | None:
    """The file's chat as a chat run's meta["chat"] holds it (`tokenizer_json.chat_meta`'s layout), or None when
    it has no template or no end-of-text token: a reply ends at the end-of-text token."""
    template = file.get("tokenizer.chat_template", None)
    if not isinstance(template, str) or tokenizer.eot_token is None:
        return None
    return {"template": template, "end_id": tokenizer.eot_token, "stop_ids": tokenizer.stop_ids,
            "tokens": tokenizer.tokens}
