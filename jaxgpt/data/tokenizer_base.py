"""The interface every tokenizer implements (`jaxgpt.data.tokenizer` has jaxgpt's own, `jaxgpt.data.tokenizer_json`
a Hugging Face tokenizer.json): a module of its own so that both can build on it without importing each other."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np


def out_of_range(ids: Sequence[int] | np.ndarray, vocab_size: int) -> list[int]:
    """The distinct ids of `ids` outside [0, vocab_size), sorted, at most five: what an error about them quotes.
    An array is compared at once; a list as Python ints, so an id past int64 (a request's JSON can hold one) is
    reported, not overflowed, and a tokenizer's `decode` converts nothing."""
    if isinstance(ids, np.ndarray):
        ids = ids[(ids < 0) | (ids >= vocab_size)].tolist()
    return sorted({int(i) for i in ids if not 0 <= i < vocab_size})[:5]


def check_ids(ids: Sequence[int], vocab_size: int) -> None:
    """A ValueError, for `decode`, when an id is outside the vocabulary (no tokenizer can say what it stands for)."""
    if bad := out_of_range(ids, vocab_size):
        raise ValueError(f"token ids {bad} are outside the vocabulary range [0, {vocab_size})")


class Tokenizer(ABC):
    """Text <-> token ids. Subclasses set `name`, `vocab_size` and `eot_token` in `__init__`."""

    name: str
    vocab_size: int
    eot_token: int | None
    unk_token: int | None = None  # the id of text outside the vocabulary (None: every text it accepts is exact)

    @abstractmethod
    def encode_array(self, text: str) -> np.ndarray:
        """Token ids of `text` as an integer array: the fast path used to tokenize whole corpora."""

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` as Python ints (prompts, tests)."""
        return self.encode_array(text).tolist()

    def encode_continuation(self, text: str) -> list[int]:
        """Token ids of `text` where it continues other ids (an answer after its prompt, an ending after its
        context): `encode` less what a tokenizer puts before a whole text (a BOS, `JsonTokenizer`)."""
        return self.encode(text)

    def encode_with_prefix(self, text: str) -> tuple[list[int], list[int]]:
        """(the ids `encode` puts before `text` (a BOS) or [], the text's own ids `encode_continuation`)."""
        ids, own = self.encode(text), self.encode_continuation(text)
        return ids[:len(ids) - len(own)], own

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`; `decode(encode(text)) == text` for every text `encode` accepts, except that word
        tokens give back the standardized text (see `WordTokenizer`)."""

    @abstractmethod
    def to_meta(self) -> dict[str, Any]:
        """A JSON-able description from which `tokenizer_from_meta` rebuilds an identical tokenizer."""

    def unknown_words(self, text: str) -> list[str]:
        """The distinct pieces of `text` that `encode` turns into `unk_token` (a prompt must have none)."""
        return []
