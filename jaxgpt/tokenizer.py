"""Tokenizers behind one small interface: a character vocabulary and the GPT-2 byte-level BPE.

A tokenizer is fully described by `to_meta()`, a JSON-able dict stored next to datasets and
checkpoints, so that sampling from a checkpoint always uses the ids the model was trained on.

The GPT-2 BPE ranks come from tiktoken, whose default source is a download from
openaipublic.blob.core.windows.net. Machines without that access point jaxgpt at a local copy of
the ranks file instead (see `load_bpe` and `jaxgpt bpe fetch`).
"""

from __future__ import annotations

import base64
import hashlib
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tiktoken

from jaxgpt.errors import UserError

EOT_TEXT = "<|endoftext|>"
GPT2_EOT = 50256
GPT2_VOCAB_SIZE = 50257
GPT2_TOKENIZER_META = {"type": "bpe", "encoding": "gpt2", "vocab_size": GPT2_VOCAB_SIZE}  # BPETokenizer.to_meta()
# "gpt2" and "r50k_base" are the same ranks, regex and special token under two names.
BPE_ENCODINGS = ("gpt2", "r50k_base")
R50K_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# The GPT-2 pre-tokenization regex (tiktoken's r50k pattern, written here so that a ranks file is all
# we need).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
BPE_FILE_ENV = "JAXGPT_BPE_FILE"
# Where `jaxgpt bpe fetch` and `.ci/provision_bpe.sh` put the ranks by default; looked at when no path is configured.
DEFAULT_BPE_FILE = Path.home() / ".cache" / "jaxgpt" / "gpt2.tiktoken"
HOW_TO_GET_BPE = (
    f"run `jaxgpt bpe fetch` (it extracts whisper/assets/gpt2.tiktoken from `pip download --no-deps "
    f"openai-whisper==20250625` into {DEFAULT_BPE_FILE}), or point {BPE_FILE_ENV} or --bpe_file at a copy"
)


class Tokenizer(ABC):
    """Text <-> token ids. Subclasses set `name`, `vocab_size` and `eot_token` in `__init__`."""

    name: str
    vocab_size: int
    eot_token: int | None

    @abstractmethod
    def encode_array(self, text: str) -> np.ndarray:
        """Token ids of `text` as an integer array: the fast path used to tokenize whole corpora."""

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` as Python ints (prompts, tests)."""
        return self.encode_array(text).tolist()

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`; `decode(encode(text)) == text` for every text `encode` accepts."""

    @abstractmethod
    def to_meta(self) -> dict[str, Any]:
        """A JSON-able description from which `tokenizer_from_meta` rebuilds an identical tokenizer."""


class CharTokenizer(Tokenizer):
    """One token per Unicode character; the vocabulary is the sorted set of characters of a corpus.

    There is no end-of-text token: a character model learns document boundaries from the text itself.
    """

    def __init__(self, chars: str) -> None:
        """`chars`: the vocabulary, strictly increasing by code point (token id = position)."""
        codepoints = np.array([ord(c) for c in chars], dtype=np.uint32)
        if len(chars) == 0 or np.any(np.diff(codepoints.astype(np.int64)) <= 0):
            raise UserError(
                "character vocabulary is empty, unsorted or has duplicates (corrupt meta.json?): "
                "re-run data preparation"
            )
        self.name = "char"
        self.chars = chars
        self.vocab_size = len(chars)
        self.eot_token = None
        self._codepoints = codepoints

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """The vocabulary of exactly the characters that occur in `text`."""
        return cls("".join(sorted(set(text))))

    def encode_array(self, text: str) -> np.ndarray:
        """Vectorized lookup (binary search over the sorted code points): a 12 M-character corpus takes
        well under a second, where a per-character dict lookup would take several."""
        # surrogatepass so that a lone surrogate becomes an unknown character rather than a crash.
        points = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        ids = np.searchsorted(self._codepoints, points)
        known = self._codepoints[np.minimum(ids, self.vocab_size - 1)] == points
        if not known.all():
            raise UserError(self._unknown_message(points[~known]))
        return ids.astype(np.int64)

    def _unknown_message(self, unknown_points: np.ndarray) -> str:
        """Name the first few unknown characters so the user can fix a prompt."""
        distinct = list(dict.fromkeys(unknown_points.tolist()))
        shown = ", ".join(repr(chr(p)) for p in distinct[:5])
        more = f" and {len(distinct) - 5} more" if len(distinct) > 5 else ""
        return (
            f"text has characters outside the {self.vocab_size}-character vocabulary: {shown}{more}; "
            "use only characters that occur in the training corpus"
        )

    def decode(self, ids: Sequence[int]) -> str:
        """Out-of-range ids are a bug (e.g. a model with the wrong vocab size), so they raise."""
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary range [0, {self.vocab_size})")
        return "".join(self.chars[i] for i in ids)

    def to_meta(self) -> dict[str, Any]:
        return {"type": "char", "chars": self.chars, "vocab_size": self.vocab_size}


class BPETokenizer(Tokenizer):
    """GPT-2 byte-level BPE (tiktoken "gpt2" / "r50k_base"; 50257 tokens, end-of-text = 50256).

    Special tokens: text is encoded as ordinary text, except that the literal string "<|endoftext|>"
    becomes the end-of-text token. That keeps `decode(encode(text)) == text` for every text (the eot
    decodes back to the same literal) and lets a plain text file mark document boundaries the way the
    GPT-2 training data did; tiktoken's default would instead raise on that literal.
    """

    def __init__(self, encoding: tiktoken.Encoding, name: str) -> None:
        self.name = name
        self.vocab_size = encoding.n_vocab
        self.eot_token = encoding.eot_token
        self._encoding = encoding

    def encode_array(self, text: str) -> np.ndarray:
        return self._encoding.encode_to_numpy(text, allowed_special={EOT_TEXT}, disallowed_special=())

    def decode(self, ids: Sequence[int]) -> str:
        """Ids that end mid-way through a UTF-8 character decode to U+FFFD (sampling can stop anywhere)."""
        return self._encoding.decode([int(i) for i in ids])

    def to_meta(self) -> dict[str, Any]:
        return {"type": "bpe", "encoding": self.name, "vocab_size": self.vocab_size}

    def token_bytes(self) -> list[bytes]:
        """The bytes of every ordinary token, by rank (what a Hugging Face export rebuilds GPT-2's files from)."""
        return [self._encoding.decode_single_token_bytes(rank) for rank in range(self.eot_token)]


def read_bpe_ranks(path: str | os.PathLike[str]) -> dict[bytes, int]:
    """Read and sha256-check a `.tiktoken` ranks file (lines of `base64(token) rank`).

    tiktoken's `load_tiktoken_bpe` would do the same, but it routes local paths through its download
    cache: it copies the 0.8 MB file into the cache dir (an error if $TIKTOKEN_CACHE_DIR is read-only)
    and afterwards serves that copy instead of reading `path`. Reading the file ourselves avoids both.
    """
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise UserError(f"cannot read BPE ranks file {path} ({e.strerror}): {HOW_TO_GET_BPE}") from e
    actual = hashlib.sha256(data).hexdigest()
    if actual != R50K_SHA256:
        raise UserError(
            f"BPE ranks file {path} has sha256 {actual[:12]}..., not the GPT-2 (r50k_base) ranks' "
            f"{R50K_SHA256}: {HOW_TO_GET_BPE}"
        )
    ranks = {}
    for line in data.splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    return ranks


def bpe_from_ranks(ranks: dict[bytes, int], name: str = "gpt2") -> BPETokenizer:
    """The GPT-2 tokenizer built from its ranks, with no network access."""
    encoding = tiktoken.Encoding(
        name=name,
        pat_str=GPT2_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={EOT_TEXT: GPT2_EOT},
        explicit_n_vocab=GPT2_VOCAB_SIZE,
    )
    return BPETokenizer(encoding, name)


def _bpe_from_tiktoken(name: str) -> BPETokenizer:
    """tiktoken's own loader (its cache dir, else a download); both names are tried since they are the
    same ranks but cached under different files. Offline, tiktoken fails fast with a ConnectionError."""
    failures = []
    for candidate in (name, *(n for n in BPE_ENCODINGS if n != name)):
        try:
            return BPETokenizer(tiktoken.get_encoding(candidate), name)
        except (OSError, ValueError) as e:  # requests' errors are OSErrors; ValueError = bad download
            failures.append(f"{candidate}: {type(e).__name__}")
    raise UserError(
        f"no GPT-2 BPE ranks available (no {BPE_FILE_ENV}, no --bpe_file, nothing at {DEFAULT_BPE_FILE}, "
        f"and tiktoken could not load or download them: {'; '.join(failures)}): {HOW_TO_GET_BPE}"
    )


def load_bpe(name: str = "gpt2", bpe_file: str | os.PathLike[str] | None = None) -> BPETokenizer:
    """The GPT-2 BPE tokenizer, from the first source that is configured.

    Order: `bpe_file` (the `--bpe_file` flag), then `$JAXGPT_BPE_FILE`, then `DEFAULT_BPE_FILE` if it
    exists (where the provisioning script puts it), then tiktoken's cache or download. A configured
    file that is missing or wrong is an error, never silently skipped: it would hide a broken setup.
    """
    if name not in BPE_ENCODINGS:
        raise UserError(f"unknown BPE encoding {name!r}: use one of {', '.join(BPE_ENCODINGS)}")
    configured = bpe_file or os.environ.get(BPE_FILE_ENV)
    if configured:
        return bpe_from_ranks(read_bpe_ranks(configured), name)
    if DEFAULT_BPE_FILE.is_file():
        return bpe_from_ranks(read_bpe_ranks(DEFAULT_BPE_FILE), name)
    return _bpe_from_tiktoken(name)


def tokenizer_from_meta(meta: dict[str, Any], bpe_file: str | os.PathLike[str] | None = None) -> Tokenizer:
    """Rebuild the tokenizer described by `Tokenizer.to_meta()` (from a dataset or checkpoint)."""
    kind = meta.get("type")
    if kind == "char" and isinstance(meta.get("chars"), str):
        return CharTokenizer(meta["chars"])
    if kind == "bpe":
        return load_bpe(meta.get("encoding", ""), bpe_file)
    raise UserError(
        f"unrecognized tokenizer description {str(meta)[:80]!r}: re-run data preparation for this dataset"
    )
