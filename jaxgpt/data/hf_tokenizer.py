"""jaxgpt's tokenizers in and out of Hugging Face directories, so that exports generate text in `transformers`.

Out (`save_hf_tokenizer`): a GPT-2 BPE run gets GPT-2's own files, `vocab.json` + `merges.txt` (rebuilt from the
tiktoken ranks, see `gpt2_vocab_and_merges`) and the `tokenizer.json` the `tokenizers` library builds from them; a
character run gets a `tokenizer.json` whose word-level vocabulary maps every character to the id jaxgpt gives it; a
word run (seed 004) a word-level `tokenizer.json` that lower-cases and splits off punctuation as
`jaxgpt.data.tokenizer.standardize` does. A chat run's special tokens (<|user|>, ..., <|end|>) are added tokens
after the vocabulary, and its chat template is the tokenizer's `chat_template`, so that `apply_chat_template` gives
the ids jaxgpt's chat format gives. A Hugging Face model's own tokenizer.json (`JsonTokenizer`, a run fine-tuned
from Llama, Qwen, Gemma...) is written back as it came, with its special tokens. All come with
`tokenizer_config.json`, written by `transformers` itself, so that `AutoTokenizer.from_pretrained(DIR)` and
`pipeline("text-generation", model=DIR)` load them. Writing needs `transformers` (an export-only dependency);
reading back (`read_tokenizer_meta`) needs only json.

In (`read_tokenizer_meta`): a directory's tokenizer as jaxgpt's `Tokenizer.to_meta()`, when it is one jaxgpt
has (GPT-2's BPE, or a character or word vocabulary such as a jaxgpt export's, with a chat run's special tokens
when it has them); None otherwise.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any

from jaxgpt.data.tokenizer import (
    EOT_TEXT,
    GPT2_EOT,
    GPT2_TOKENIZER_META,
    GPT2_VOCAB_SIZE,
    WORD_PAD,
    WORD_PUNCTUATION,
    WORD_SPECIALS,
    WORD_UNK,
    BPETokenizer,
    Tokenizer,
    WithSpecialTokens,
    WordTokenizer,
    standardize,
)
from jaxgpt.data.tokenizer_json import JsonTokenizer
from jaxgpt.errors import UserError, optional_import

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
VOCAB_FILE = "vocab.json"
MERGES_FILE = "merges.txt"
# Matches any one character, newlines included: the character tokenizer's pre-tokenizer splits on it.
ONE_CHARACTER = r"[\s\S]"
# Two GPT-2 vocabulary entries that fingerprint its BPE: another byte-level BPE of 50257 tokens would
# have to agree on them too.
GPT2_FINGERPRINT = {"!": 0, "\u0120the": 262, EOT_TEXT: GPT2_EOT}


def require_transformers() -> None:
    """A one-line error, before anything is written, when the export cannot write a tokenizer."""
    _need_transformers()


def _need_transformers() -> Any:
    transformers = optional_import("transformers", "exporting a tokenizer for Hugging Face")
    return optional_import("tokenizers", "exporting a tokenizer for Hugging Face"), transformers


# ---------------------------------------------------------------------------------------------------
# GPT-2's vocab.json and merges.txt from the tiktoken ranks


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for every byte: bytes that print as themselves keep their character, the
    others (controls, space, a few Latin-1 ones) get code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in table)
    table.update({b: chr(256 + i) for i, b in enumerate(extra)})
    return table


def _merge_halves(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The two tokens whose merge made `token`: run BPE on its bytes until two parts are left.

    BPE always merges the adjacent pair of lowest rank (ties: leftmost), exactly as the tokenizer would,
    so the last two parts are the pair this token's merge rule joins.
    """
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        i = min(range(len(parts) - 1), key=lambda j: (ranks.get(parts[j] + parts[j + 1], GPT2_VOCAB_SIZE), j))
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts[0], parts[1]


def gpt2_vocab_and_merges(token_bytes: list[bytes]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """GPT-2's encoder.json vocabulary and its merge rules, in rank order, from the bytes of each rank.

    Ranks 0..255 are the single bytes; every later rank is one merge of two earlier tokens.
    """
    ranks = {token: rank for rank, token in enumerate(token_bytes)}
    table = byte_to_unicode()

    def text(token: bytes) -> str:
        return "".join(table[b] for b in token)

    vocab = {text(token): rank for rank, token in enumerate(token_bytes)}
    vocab[EOT_TEXT] = GPT2_EOT
    merges = [tuple(map(text, _merge_halves(token, ranks))) for token in token_bytes if len(token) > 1]
    return vocab, merges


# ---------------------------------------------------------------------------------------------------
# Writing


def _gpt2_backend(tokenizer: BPETokenizer) -> Any:
    """GPT-2's byte-level BPE as a `tokenizers.Tokenizer`, with <|endoftext|> as its special token."""
    tokenizers, _ = _need_transformers()
    vocab, merges = gpt2_vocab_and_merges(tokenizer.token_bytes())
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    backend.post_processor = tokenizers.processors.ByteLevel(trim_offsets=False)
    backend.add_special_tokens([tokenizers.AddedToken(EOT_TEXT, special=True)])
    return backend


def _char_backend(chars: str) -> Any:
    """One token per character with jaxgpt's ids; decoding concatenates them (no spaces in between)."""
    tokenizers, _ = _need_transformers()
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab={c: i for i, c in enumerate(chars)},
                                                               unk_token=None))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex(ONE_CHARACTER), "isolated")
    backend.decoder = tokenizers.decoders.Fuse()
    return backend


def _word_backend(tokenizer: WordTokenizer) -> Any:
    """Seed 004's words with jaxgpt's ids: lower-case, split at whitespace, then each punctuation character on its
    own; [PAD] (the end of a text) is special, [UNK] is not, so that decoding writes it as jaxgpt does. With no
    decoder, `tokenizers` joins the tokens with spaces, as `WordTokenizer.decode` does. (transformers 5's
    text-generation pipeline appends the decoded new words to the prompt with no space between them.)"""
    tokenizers, _ = _need_transformers()
    vocab = {token: i for i, token in enumerate(tokenizer.tokens)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token=WORD_UNK))
    backend.normalizer = tokenizers.normalizers.Lowercase()
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.WhitespaceSplit(),
        tokenizers.pre_tokenizers.Split(tokenizers.Regex(WORD_PUNCTUATION), "isolated"),
    ])
    backend.add_special_tokens([tokenizers.AddedToken(WORD_PAD, special=True, normalized=False)])
    backend.add_tokens([tokenizers.AddedToken(WORD_UNK, special=False, normalized=False)])
    return backend


def _backend(tokenizer: Tokenizer) -> tuple[Any, dict[str, Any]]:
    """The `tokenizers.Tokenizer` of one of jaxgpt's tokenizers, and its special tokens' roles (and BOS rule)."""
    if isinstance(tokenizer, JsonTokenizer):  # a Hugging Face model's own: its file as it came, with its roles
        tokenizers, _ = _need_transformers()
        return tokenizers.Tokenizer.from_str(tokenizer.json_text), {**tokenizer.tokens,
                                                                     "add_bos_token": tokenizer.add_bos}
    if isinstance(tokenizer, BPETokenizer):
        return _gpt2_backend(tokenizer), dict(bos_token=EOT_TEXT, eos_token=EOT_TEXT, unk_token=EOT_TEXT)
    if tokenizer.to_meta()["type"] == "char":
        return _char_backend(tokenizer.to_meta()["chars"]), {}
    if isinstance(tokenizer, WordTokenizer):
        return _word_backend(tokenizer), dict(eos_token=WORD_PAD, pad_token=WORD_PAD)
    raise UserError(f"cannot export a {tokenizer.name!r} tokenizer for Hugging Face")


def save_hf_tokenizer(tokenizer: Tokenizer, out: str | os.PathLike[str], max_length: int,
                      chat_template: str | None = None) -> None:
    """Write `tokenizer` into the export directory `out` (`max_length`: the model's positions).

    Decoding must give back exactly the text jaxgpt decodes, so transformers' clean-up of spaces before
    punctuation is switched off. The class is named PreTrainedTokenizerFast, which transformers 4 loads
    and transformers 5 keeps as an alias of the class it writes. A chat run's special tokens come with it, and
    its `chat_template` (the Jinja2 text `jaxgpt serve` renders), which `apply_chat_template` renders alike.
    `tokenizers` matches an added special token anywhere in the raw text (before normalizing and pre-tokenizing)
    and numbers new ones after the vocabulary, as `WithSpecialTokens` does: so both give the same ids.
    """
    tokenizers, transformers = _need_transformers()
    root = Path(out)
    base = tokenizer.base if isinstance(tokenizer, WithSpecialTokens) else tokenizer
    backend, special = _backend(base)
    if isinstance(tokenizer, WithSpecialTokens):
        backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                                    for t in tokenizer.specials])
    if isinstance(base, BPETokenizer):
        backend.model.save(str(root))  # GPT-2's vocab.json + merges.txt, for tools that read those
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False,
                                                model_max_length=max_length, chat_template=chat_template, **special)
    fast.save_pretrained(str(root))
    config = _read_json(root / CONFIG_FILE)
    (root / CONFIG_FILE).write_text(json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2))


def save_generation_config(tokenizer: Tokenizer | None, out: str | os.PathLike[str], end_token: int | None = None
                           ) -> None:
    """generation_config.json: where a sample ends. GPT-2's end-of-text or a word vocabulary's [PAD] (a character
    vocabulary has none), a Hugging Face tokenizer's stop tokens (with its BOS); a chat run's reply also ends at
    <|end|> (`end_token`), listed first."""
    _, transformers = _need_transformers()
    base = tokenizer.base if isinstance(tokenizer, WithSpecialTokens) else tokenizer
    eot_token = None if tokenizer is None else tokenizer.eot_token
    more, bos = (base.stop_ids, base.bos_token) if isinstance(base, JsonTokenizer) else ((), eot_token)
    stops = list(dict.fromkeys(i for i in (end_token, eot_token, *more) if i is not None))
    ids = {} if not stops else dict(bos_token_id=bos, eos_token_id=stops if len(stops) > 1 else stops[0],
                                    pad_token_id=stops[-1])
    transformers.GenerationConfig(**ids).save_pretrained(str(out))


# ---------------------------------------------------------------------------------------------------
# Reading


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read {path}: {e}") from None


def _is_gpt2_vocab(vocab: dict[str, int]) -> bool:
    return len(vocab) == GPT2_VOCAB_SIZE and all(vocab.get(k) == v for k, v in GPT2_FINGERPRINT.items())


def _char_meta(vocab: dict[str, int]) -> dict[str, Any] | None:
    """A character vocabulary jaxgpt's CharTokenizer reproduces: ids 0..n-1 in code-point order."""
    ordered = sorted(vocab, key=vocab.__getitem__)
    if not all(len(c) == 1 for c in ordered) or [vocab[c] for c in ordered] != list(range(len(ordered))):
        return None
    if any(ord(a) >= ord(b) for a, b in itertools.pairwise(ordered)):
        return None
    chars = "".join(ordered)
    return {"type": "char", "chars": chars, "vocab_size": len(chars)}


def _word_meta(spec: dict[str, Any], vocab: dict[str, int]) -> dict[str, Any] | None:
    """A word vocabulary jaxgpt's WordTokenizer reproduces: [PAD], [UNK], then standardized words, ids 0..n-1,
    behind the lower-casing normalizer and the punctuation split that `_word_backend` writes."""
    ordered = sorted(vocab, key=vocab.__getitem__)
    if tuple(ordered[:2]) != WORD_SPECIALS or [vocab[t] for t in ordered] != list(range(len(ordered))):
        return None
    steps = (spec.get("pre_tokenizer") or {}).get("pretokenizers") or [{}, {}]
    if ((spec.get("normalizer") or {}).get("type") != "Lowercase"
            or [step.get("type") for step in steps] != ["WhitespaceSplit", "Split"]
            or steps[1].get("pattern") != {"Regex": WORD_PUNCTUATION}):
        return None
    words = ordered[2:]
    if not words or any(standardize(w) != [w] for w in words):
        return None
    return {"type": "word", "words": words, "vocab_size": len(ordered)}


def has_hf_tokenizer(path: str | os.PathLike[str]) -> bool:
    """Whether the directory carries a tokenizer of its own (then only that one may describe its ids)."""
    root = Path(path)
    return (root / TOKENIZER_FILE).is_file() or (root / VOCAB_FILE).is_file()


def _chat_specials(spec: dict[str, Any], vocab: dict[str, int]) -> tuple[dict[str, int], list[str]] | None:
    """The vocabulary without a chat run's special tokens, and those tokens in id order: the added special tokens
    other than the base tokenizer's own (<|endoftext|>, [PAD]). None when they do not follow the vocabulary, as
    `WithSpecialTokens` numbers them."""
    own = (EOT_TEXT, WORD_PAD)
    added = sorted((t["id"], t["content"]) for t in spec.get("added_tokens") or []
                   if isinstance(t, dict) and t.get("special") and t.get("content") not in own)
    specials = [content for _, content in added]
    base = {token: i for token, i in vocab.items() if token not in specials}
    if [i for i, _ in added] != list(range(len(base), len(base) + len(added))):
        return None
    return base, specials


def _tokenizer_json_meta(spec: Any) -> dict[str, Any] | None:
    """jaxgpt's description of a tokenizer.json, a chat run's special tokens included."""
    model = spec.get("model") if isinstance(spec, dict) else None
    if not isinstance(model, dict):
        return None
    vocab = dict(model.get("vocab") or {})
    vocab.update({t["content"]: t["id"] for t in spec.get("added_tokens") or [] if isinstance(t, dict)})
    split = _chat_specials(spec, vocab)
    if split is None:
        return None
    vocab, specials = split
    meta = None
    if model.get("type") == "BPE" and _is_gpt2_vocab(vocab):
        meta = dict(GPT2_TOKENIZER_META)
    elif model.get("type") == "WordLevel":
        meta = _word_meta(spec, vocab) or _char_meta(vocab)
    if meta is None or not specials:
        return meta
    return {**meta, "vocab_size": meta["vocab_size"] + len(specials), "special_tokens": specials}


def read_tokenizer_meta(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """jaxgpt's description of the tokenizer in a Hugging Face directory, or None when it has none jaxgpt knows."""
    root = Path(path)
    if (root / TOKENIZER_FILE).is_file():
        return _tokenizer_json_meta(_read_json(root / TOKENIZER_FILE))
    if (root / VOCAB_FILE).is_file() and (root / MERGES_FILE).is_file():  # the original OpenAI upload's layout
        vocab = _read_json(root / VOCAB_FILE)
        return dict(GPT2_TOKENIZER_META) if isinstance(vocab, dict) and _is_gpt2_vocab(vocab) else None
    return None
