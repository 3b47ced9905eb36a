"""A Hugging Face `tokenizer.json` as a jaxgpt `Tokenizer`: Llama, Mistral, Qwen, Gemma and SmolLM's tokenizers.

The `tokenizers` library runs the file as transformers' fast tokenizers do (normalizer, pre-tokenizer, BPE or
Unigram model, added tokens matched anywhere in the text, byte-level or byte-fallback decoding), so the ids are
`AutoTokenizer`'s. The file's JSON text travels in `to_meta()` (type "tokenizer.json"), with what the directory's
other files add: so a run fine-tuned from the model, or a checkpoint, needs nothing but its own meta.

    {"type": "tokenizer.json", "json": TEXT, "vocab_size": V, "bos_token": ID | None, "add_bos": BOOL,
     "eot_token": ID | None, "stop_ids": [ID, ...], "tokens": {"bos_token": "<s>", "eos_token": "</s>", ...}}

* The BOS rule: `encode` starts a text with `bos_token` when `add_bos` (tokenizer_config.json's `add_bos_token`,
  else whether the file's post-processor puts a token before the text), as `AutoTokenizer`'s `encode` does, except
  that a text already starting with it (a chat template that writes `{{ bos_token }}`) does not get a second one,
  and that a text continuing others (`encode_continuation`: an RL answer, an evaluation's ending) gets none.
  Nothing is appended: these causal models' post-processors add nothing after the text.
* `eot_token` ends a sample (tokenizer_config.json's `eos_token`, else generation_config.json's first
  `eos_token_id`); `stop_ids` are all the ids generation_config.json and tokenizer_config.json end a sample at
  (Llama 3 Instruct: <|end_of_text|>, <|eom_id|>, <|eot_id|>).
* `tokens`: the special tokens' text a chat template sees (`bos_token`, `eos_token`, `unk_token`, `pad_token`).

Decoding writes special tokens as their text (`decode(encode(text)) == text`, as for `WithSpecialTokens`); ids that
end inside a UTF-8 character decode to U+FFFD, which `StreamDecoder` holds back until the rest arrives.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxgpt.data.tokenizer_base import Tokenizer, check_ids
from jaxgpt.errors import UserError, one_line, optional_import

TYPE = "tokenizer.json"
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
GENERATION_FILE = "generation_config.json"
TEMPLATE_FILE = "chat_template.jinja"  # transformers 5 writes the template here, 4 inside tokenizer_config.json
TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _backend(json_text: str, where: str) -> Any:
    tokenizers = optional_import("tokenizers", f"reading {where}", package="tokenizers")
    try:
        return tokenizers.Tokenizer.from_str(json_text)
    except Exception as e:  # the Rust library raises its own exception type for malformed files
        raise UserError(f"{where} is not a tokenizer the `tokenizers` library reads: {one_line(e, 120)}"
                        ) from None


class JsonTokenizer(Tokenizer):
    """A `tokenizer.json` run by the `tokenizers` library, with its directory's BOS rule and stop tokens."""

    def __init__(self, json_text: str, *, bos_token: int | None = None, add_bos: bool = False,
                 eot_token: int | None = None, stop_ids: Sequence[int] = (), tokens: dict[str, str] | None = None,
                 where: str = TOKENIZER_FILE) -> None:
        self._backend = _backend(json_text, where)
        self.json_text = json_text
        self.name = TYPE
        ids = [*self._backend.get_vocab(with_added_tokens=True).values()]
        self.vocab_size = max(ids) + 1
        if add_bos and bos_token is None:
            raise UserError(f"{where}: add_bos_token is set, but the tokenizer names no bos_token")
        self.bos_token, self.add_bos, self.eot_token = bos_token, add_bos, eot_token
        self.stop_ids = [int(i) for i in stop_ids]
        self.tokens = dict(tokens or {})

    def encode_array(self, text: str) -> np.ndarray:
        return self.encode_offsets(text)[0]

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """`encode_array(text)` and, per id, the offset in `text` of its first character (0 for a BOS put before
        it): what finds the tokens of a span of rendered text (a chat template's assistant turn)."""
        encoding = self._backend.encode(text, add_special_tokens=False)
        ids, starts = list(encoding.ids), [start for start, _ in encoding.offsets]
        if self.add_bos and (not ids or ids[0] != self.bos_token):
            ids, starts = [self.bos_token, *ids], [0, *starts]
        return np.asarray(ids, dtype=np.int64), np.asarray(starts, dtype=np.int64)

    def encode_continuation(self, text: str) -> list[int]:
        return list(self._backend.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        check_ids(ids, self.vocab_size)
        return self._backend.decode(ids, skip_special_tokens=False)

    def to_meta(self) -> dict[str, Any]:
        return {"type": TYPE, "json": self.json_text, "vocab_size": self.vocab_size, "bos_token": self.bos_token,
                "add_bos": self.add_bos, "eot_token": self.eot_token, "stop_ids": list(self.stop_ids),
                "tokens": dict(self.tokens)}

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> JsonTokenizer:
        if not isinstance(meta.get("json"), str):
            raise UserError("a tokenizer.json description without its JSON text (corrupt meta.json?): re-run the "
                            "fine-tuning that wrote it")
        return cls(meta["json"], bos_token=meta.get("bos_token"), add_bos=bool(meta.get("add_bos")),
                   eot_token=meta.get("eot_token"), stop_ids=meta.get("stop_ids") or (), tokens=meta.get("tokens"),
                   where="the checkpoint's tokenizer.json")

    def token_id(self, text: str) -> int | None:
        return self._backend.token_to_id(text)


# ---------------------------------------------------------------------------------------------------
# A Hugging Face directory's tokenizer


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read {path}: {e}") from None
    return value if isinstance(value, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token of tokenizer_config.json: a string, or (older files) an AddedToken dict with `content`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def read_json_tokenizer(path: str | Path, model_vocab: int | None = None) -> JsonTokenizer:
    """The tokenizer of a Hugging Face directory with a `tokenizer.json`; `model_vocab`: the model's vocab_size,
    which may pad past the tokenizer's (those ids are never sampled) but must not be smaller."""
    root = Path(path)
    json_text = (root / TOKENIZER_FILE).read_text(encoding="utf-8")
    config, generation = _read_json(root / CONFIG_FILE), _read_json(root / GENERATION_FILE)
    backend = _backend(json_text, str(root / TOKENIZER_FILE))
    tokens = {name: text for name in TEMPLATE_TOKENS if (text := _token_text(config.get(name))) is not None}
    bos = backend.token_to_id(tokens["bos_token"]) if "bos_token" in tokens else None
    bos = bos if bos is not None else next(iter(_ids(generation.get("bos_token_id"))), None)
    if isinstance(config.get("add_bos_token"), bool):
        add_bos = config["add_bos_token"]
    else:  # the post-processor's template: does it put a token before the text?
        plain, full = (backend.encode("a", add_special_tokens=flag).ids for flag in (False, True))
        add_bos = bos is not None and full[:1] == [bos] and plain[:1] != [bos]
    eos = backend.token_to_id(tokens["eos_token"]) if "eos_token" in tokens else None
    stops = list(dict.fromkeys([*([] if eos is None else [eos]), *_ids(generation.get("eos_token_id"))]))
    tokenizer = JsonTokenizer(json_text, bos_token=bos, add_bos=add_bos, eot_token=stops[0] if stops else None,
                              stop_ids=stops, tokens=tokens, where=str(root / TOKENIZER_FILE))
    if model_vocab is not None and tokenizer.vocab_size > model_vocab:
        raise UserError(f"{root / TOKENIZER_FILE} has {tokenizer.vocab_size} tokens, more than the model's "
                        f"vocab_size={model_vocab}: it is not this model's tokenizer")
    return tokenizer


def read_chat_template(path: str | Path) -> str | None:
    """The directory's chat template: chat_template.jinja (transformers 5), else tokenizer_config.json's
    `chat_template` (a string, or a list of named templates of which "default" is the one used)."""
    root = Path(path)
    if (root / TEMPLATE_FILE).is_file():
        return (root / TEMPLATE_FILE).read_text(encoding="utf-8")
    template = _read_json(root / CONFIG_FILE).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def chat_meta(path: str | Path, tokenizer_meta: dict[str, Any]) -> dict[str, Any] | None:
    """A directory's chat as a chat run's meta["chat"] holds it, or None without a template: the template, the
    special tokens' text it sees, the token a reply ends at (the first stop token the template writes: Llama 3's
    <|eot_id|>, Qwen's <|im_end|>, Gemma's <end_of_turn>; else the end-of-text token) and every stop token."""
    template = read_chat_template(path)
    if template is None or tokenizer_meta.get("eot_token") is None:
        return None
    tokenizer = JsonTokenizer.from_meta(tokenizer_meta)
    written = [i for i in tokenizer.stop_ids if tokenizer.decode([i]) in template]
    return {"template": template, "end_id": (written or [tokenizer.eot_token])[0], "stop_ids": tokenizer.stop_ids,
            "tokens": tokenizer.tokens}
