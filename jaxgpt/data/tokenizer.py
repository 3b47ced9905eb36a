"""Tokenizers behind one small interface: a character vocabulary, the GPT-2 byte-level BPE, and words.

A tokenizer is fully described by `to_meta()`, a JSON-able dict stored next to datasets and
checkpoints, so that sampling from a checkpoint always uses the ids the model was trained on.

The GPT-2 BPE ranks come from tiktoken (a download), or offline a local copy (`load_bpe`, `jaxgpt bpe fetch`). A
Hugging Face tokenizer.json is `jaxgpt.data.tokenizer_json`.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import os
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tiktoken

from jaxgpt.data.tokenizer_base import Tokenizer, check_ids
from jaxgpt.errors import UserError
from jaxgpt.storage import cache_root

EOT_TEXT = "<|endoftext|>"
GPT2_EOT = 50256
GPT2_VOCAB_SIZE = 50257
GPT2_TOKENIZER_META = {"type": "bpe", "encoding": "gpt2", "vocab_size": GPT2_VOCAB_SIZE}  # BPETokenizer.to_meta()
# "gpt2" and "r50k_base" are the same ranks, regex and special token under two names.
BPE_ENCODINGS = ("gpt2", "r50k_base")
R50K_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# The GPT-2 pre-tokenization regex (tiktoken's r50k pattern, written here so that a ranks file is all we need).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
# tiktoken's larger encodings (ids past uint16): their ranks URL and sha256. tiktoken loads them from its cache
# or downloads them; offline, `bpe_file` names a copy, which tiktoken then reads from a cache jaxgpt keeps.
TIKTOKEN_ENCODINGS = {
    "cl100k_base": ("https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken",
                    "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"),
    "o200k_base": ("https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken",
                   "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"),
}
BPE_FILE_ENV = "JAXGPT_BPE_FILE"
# Where `jaxgpt bpe fetch` and `.ci/provision_bpe.sh` put the ranks by default; looked at when no path is configured.
DEFAULT_BPE_FILE = Path.home() / ".cache" / "jaxgpt" / "gpt2.tiktoken"
HOW_TO_GET_BPE = (
    f"run `jaxgpt bpe fetch` (it extracts whisper/assets/gpt2.tiktoken from `pip download --no-deps "
    f"openai-whisper==20250625` into {DEFAULT_BPE_FILE}), or point {BPE_FILE_ENV} or --bpe_file at a copy"
)


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
        check_ids(ids, self.vocab_size)
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


# Word tokens (seed 004). Two special tokens come first; their literal text in a string is that token, the
# way BPE reads "<|endoftext|>", so decoded text encodes back to the same ids.
WORD_PAD, WORD_PAD_ID = "[PAD]", 0  # padding, and the end-of-text token between documents
WORD_UNK, WORD_UNK_ID = "[UNK]", 1  # every word outside the vocabulary
WORD_SPECIALS = (WORD_PAD, WORD_UNK)
# Python's string.punctuation (the ASCII punctuation characters, written as ranges both Python's and the exported
# tokenizer's regex engines read alike): each is a token of its own, as seed 004 pads them.
WORD_PUNCTUATION = r"[!-/:-@\[-`{-~]"
# Unicode's White_Space set (what Rust's char::is_whitespace and so the exported tokenizer split on); Python's
# `\s` would also split on U+001C..U+001F, which the exported tokenizer keeps inside words.
_WHITESPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_WORD_PIECE = re.compile(f"{WORD_PUNCTUATION}|[^{_WHITESPACE}{WORD_PUNCTUATION[1:-1]}]+")
_SPECIAL_SPLIT = re.compile("(" + "|".join(map(re.escape, WORD_SPECIALS)) + ")")


def standardize(text: str) -> list[str]:
    """Seed 004's words: lower-cased text split at whitespace, each punctuation character a word of its own.

    Nothing but whitespace is dropped. Capital sigma is lowered on its own first: `str.lower` writes a final
    sigma at the end of a word, while the exported tokenizer lowers character by character.
    """
    return _WORD_PIECE.findall(text.replace("\u03a3", "\u03c3").lower())


def _word_tokens(text: str) -> list[str]:
    """The token strings of `text`: standardized words, and the special tokens where their literal text is."""
    tokens: list[str] = []
    for i, piece in enumerate(_SPECIAL_SPLIT.split(text)):
        tokens += [piece] if i % 2 else standardize(piece)
    return tokens


class WordTokenizer(Tokenizer):
    """Seed 004's word-level tokens: id 0 is [PAD] (also the end-of-text token), 1 is [UNK], 2.. are words.

    Encoding is `standardize` (lower case, punctuation split off) followed by a vocabulary lookup, and words
    outside the vocabulary become [UNK]. Decoding joins the tokens with single spaces, so it gives back the
    standardized text, not the original: case, and the spacing around punctuation and between words, are
    lost, exactly as in the article. What does hold: `encode(decode(ids)) == ids` for every `ids` that
    `encode` returns, and `decode(encode(text))` is `" ".join(standardize(text))` when every word is known
    (and the text does not spell out a special token).
    """

    def __init__(self, words: Sequence[str]) -> None:
        """`words`: the vocabulary after the two special tokens (token id = position + 2), each a standardized
        word."""
        words = list(words)
        bad = [w for w in words if not isinstance(w, str) or w in WORD_SPECIALS or standardize(w) != [w]]
        if not words or bad or len(set(words)) != len(words):
            raise UserError(
                f"word vocabulary is empty, has duplicates or entries that are not single standardized words "
                f"({bad[:3]}; corrupt meta.json?): re-run data preparation"
            )
        self.name = "word"
        self.words = words
        self.tokens = [*WORD_SPECIALS, *words]
        self.vocab_size = len(self.tokens)
        self.eot_token = WORD_PAD_ID
        self.unk_token = WORD_UNK_ID
        self._ids = {token: i for i, token in enumerate(self.tokens)}

    @classmethod
    def from_texts(cls, texts: Iterable[str], vocab_size: int) -> WordTokenizer:
        """The `vocab_size - 2` most frequent words of `texts` (ties: in code-point order, so the same texts
        always give the same ids) after the two special tokens; fewer when the texts have fewer words."""
        if vocab_size < len(WORD_SPECIALS) + 1:
            raise UserError(f"word vocabulary size {vocab_size} leaves no room for words after {WORD_PAD} and "
                            f"{WORD_UNK}: use at least 3 (seed 004 uses 10000)")
        counts: Counter[str] = Counter()
        for text in texts:
            counts.update(t for t in _word_tokens(text) if t not in WORD_SPECIALS)
        if not counts:
            raise UserError("the text has no words to build a word vocabulary from: give non-empty text")
        ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
        return cls([word for word, _ in ranked[: vocab_size - len(WORD_SPECIALS)]])

    def encode_array(self, text: str) -> np.ndarray:
        ids = self._ids
        return np.array([ids.get(t, WORD_UNK_ID) for t in _word_tokens(text)], dtype=np.int64)

    def unknown_words(self, text: str) -> list[str]:
        return list(dict.fromkeys(t for t in _word_tokens(text) if t not in self._ids))

    def decode(self, ids: Sequence[int]) -> str:
        """Out-of-range ids are a bug (e.g. a model with the wrong vocab size), so they raise."""
        check_ids(ids, self.vocab_size)
        return " ".join(self.tokens[i] for i in ids)

    def to_meta(self) -> dict[str, Any]:
        return {"type": "word", "words": list(self.words), "vocab_size": self.vocab_size}


class WithSpecialTokens(Tokenizer):
    """A tokenizer plus special tokens (a chat format's role and end markers) whose ids follow its vocabulary.

    The literal text of a special token anywhere in a string is that token, as "<|endoftext|>" is for BPE: so a
    chat template rendered to text (`jaxgpt.data.conversations`) encodes to the ids the model was fine-tuned on,
    whichever tokenizer is underneath (characters, words or GPT-2 BPE), and `decode` writes each back as its
    literal. The text between special tokens is encoded by the base tokenizer piece by piece, which is what
    tiktoken does with its own special tokens, so one code path serves every tokenizer; what the base puts before
    a whole text (`prefix`: a Llama-style BOS) starts the whole text once, not each piece.
    """

    def __init__(self, base: Tokenizer, specials: Sequence[str]) -> None:
        specials = list(specials)
        bad = [t for t in specials if not isinstance(t, str) or not t or t == EOT_TEXT or t in WORD_SPECIALS]
        if not specials or bad or len(set(specials)) != len(specials) or isinstance(base, WithSpecialTokens):
            raise UserError(f"special tokens {specials[:6]} are empty, repeated or clash with the tokenizer's own "
                            "(corrupt meta.json?): re-run the fine-tuning that wrote them")
        self.base, self.specials = base, specials
        self.name = base.name
        self.vocab_size = base.vocab_size + len(specials)
        self.eot_token = base.eot_token
        self.unk_token = base.unk_token
        self.special_ids = {t: base.vocab_size + i for i, t in enumerate(specials)}
        self.prefix = base.encode_with_prefix("")[0]
        # Longest first, so that a special token that is a prefix of another never splits it.
        self._split = re.compile("(" + "|".join(map(re.escape, sorted(specials, key=len, reverse=True))) + ")")

    def encode_array(self, text: str) -> np.ndarray:
        own = self.encode_continuation(text)
        return np.array(own if own[:len(self.prefix)] == self.prefix else [*self.prefix, *own], np.int64)

    def encode_continuation(self, text: str) -> list[int]:
        return [i for n, piece in enumerate(self._split.split(text)) if piece
                for i in ([self.special_ids[piece]] if n % 2 else self.base.encode_continuation(piece))]

    def decode(self, ids: Sequence[int]) -> str:
        check_ids(ids, self.vocab_size)
        n = self.base.vocab_size
        return "".join(self.base.decode(list(run)) if ordinary else "".join(self.specials[i - n] for i in run)
                       for ordinary, run in itertools.groupby((int(i) for i in ids), key=lambda i: i < n))

    def to_meta(self) -> dict[str, Any]:
        return {**self.base.to_meta(), "vocab_size": self.vocab_size, "special_tokens": list(self.specials)}

    def unknown_words(self, text: str) -> list[str]:
        return [w for i, p in enumerate(self._split.split(text)) if not i % 2 for w in self.base.unknown_words(p)]


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


def _tiktoken_encoding(name: str, bpe_file: str | os.PathLike[str] | None) -> BPETokenizer:
    """cl100k_base / o200k_base: tiktoken's loader, reading `bpe_file` (checked here first) when one is given."""
    url, sha256 = TIKTOKEN_ENCODINGS[name]
    how = f"download {url} where there is network and pass its path with --bpe_file (config.data.bpe_file)"
    if bpe_file:
        try:
            data = Path(bpe_file).read_bytes()
        except OSError as e:
            raise UserError(f"cannot read BPE ranks file {bpe_file} ({e.strerror}): {how}") from None
        if hashlib.sha256(data).hexdigest() != sha256:
            raise UserError(f"BPE ranks file {bpe_file} is not {name}'s (its sha256 differs): {how}")
        cache = cache_root() / "tiktoken"
        cache.mkdir(parents=True, exist_ok=True)
        cached = cache / hashlib.sha1(url.encode()).hexdigest()  # the name tiktoken's cache gives `url`
        if not cached.is_file():
            partial = cached.with_suffix(f".{os.getpid()}.partial")
            partial.write_bytes(data)
            os.replace(partial, cached)
        os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)
    try:
        return BPETokenizer(tiktoken.get_encoding(name), name)
    except (OSError, ValueError) as e:  # requests' errors are OSErrors; ValueError = bad download
        raise UserError(f"tiktoken could not load or download {name} ({type(e).__name__}): {how}") from None


def load_bpe(name: str = "gpt2", bpe_file: str | os.PathLike[str] | None = None) -> BPETokenizer:
    """A BPE tokenizer: GPT-2's from the first source that is configured, or tiktoken's larger encodings.

    Order: `bpe_file` (the `--bpe_file` flag), then `$JAXGPT_BPE_FILE`, then `DEFAULT_BPE_FILE` if it
    exists (where the provisioning script puts it), then tiktoken's cache or download. A configured
    file that is missing or wrong is an error, never silently skipped: it would hide a broken setup.
    """
    if name in TIKTOKEN_ENCODINGS:
        return _tiktoken_encoding(name, bpe_file)
    if name not in BPE_ENCODINGS:
        raise UserError(f"unknown BPE encoding {name!r}: use one of {', '.join([*BPE_ENCODINGS, *TIKTOKEN_ENCODINGS])}")
    ranks = bpe_file or configured_bpe_file()
    if bpe_file or os.environ.get(BPE_FILE_ENV) or ranks.is_file():  # (only the default may be absent)
        return bpe_from_ranks(read_bpe_ranks(ranks), name)
    return _bpe_from_tiktoken(name)


def configured_bpe_file() -> Path:
    """Where GPT-2's ranks are when no --bpe_file names them: $JAXGPT_BPE_FILE, else DEFAULT_BPE_FILE (where
    `jaxgpt bpe fetch` puts them by default)."""
    return Path(os.environ.get(BPE_FILE_ENV) or DEFAULT_BPE_FILE)


def tokenizer_from_meta(meta: dict[str, Any], bpe_file: str | os.PathLike[str] | None = None) -> Tokenizer:
    """Rebuild the tokenizer described by `Tokenizer.to_meta()` (from a dataset or checkpoint)."""
    if "special_tokens" in meta:
        base = tokenizer_from_meta({k: v for k, v in meta.items() if k != "special_tokens"}, bpe_file)
        return WithSpecialTokens(base, meta["special_tokens"])
    kind = meta.get("type")
    if kind == "char" and isinstance(meta.get("chars"), str):
        return CharTokenizer(meta["chars"])
    if kind == "word" and isinstance(meta.get("words"), list):
        return WordTokenizer(meta["words"])
    if kind == "bpe":
        return load_bpe(meta.get("encoding", ""), bpe_file)
    if kind == "tokenizer.json":  # a Hugging Face tokenizer (needs the `tokenizers` library)
        from jaxgpt.data.tokenizer_json import JsonTokenizer
        return JsonTokenizer.from_meta(meta)
    raise UserError(
        f"unrecognized tokenizer description {str(meta)[:80]!r}: re-run data preparation for this dataset"
    )


def same_tokenizer(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two tokenizer metas give the same ids ("gpt2" and "r50k_base" are one BPE under two names)."""
    if a.get("special_tokens") != b.get("special_tokens"):
        return False
    if a.get("type") == b.get("type") == "bpe":
        family = lambda m: "gpt2" if m.get("encoding", "gpt2") in BPE_ENCODINGS else m.get("encoding")
        return family(a) == family(b)
    if a.get("type") == b.get("type") and a.get("type") in ("word", "tokenizer.json"):
        return {**a, "vocab_size": 0} == {**b, "vocab_size": 0}
    return a.get("type") == b.get("type") == "char" and a.get("chars") == b.get("chars")


def describe_tokenizer(meta: dict[str, Any]) -> str:
    if specials := meta.get("special_tokens"):
        base = describe_tokenizer({**{k: v for k, v in meta.items() if k != "special_tokens"},
                                   "vocab_size": meta.get("vocab_size", len(specials)) - len(specials)})
        return f"{base} + {len(specials)} special tokens"
    if meta.get("type") in ("word", "tokenizer.json"):
        return f"a {meta.get('vocab_size')}-{'word vocabulary' if meta['type'] == 'word' else 'token tokenizer.json'}"
    if meta.get("type") == "bpe":
        return "GPT-2 BPE" if meta.get("encoding", "gpt2") in BPE_ENCODINGS else f"tiktoken's {meta.get('encoding')}"
    return f"a {meta.get('vocab_size')}-character vocabulary"
