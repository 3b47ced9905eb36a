"""Seed 004's word tokens: round trips on random text, unknown words reported, a deterministic vocabulary, the
wine-reviews recipe end to end on a tiny CSV (prepare, train configs/seed004.py shrunk, sample, export)."""

from __future__ import annotations

import json
import random
import re
import string
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT
from helpers.models import random_params, save_run

from jaxgpt.commands import data as data_command
from jaxgpt.commands import hf as hf_command
from jaxgpt.commands import sample as sample_command
from jaxgpt.commands import train as train_command
from jaxgpt.data.corpora import prepare_builtin, wine_reviews
from jaxgpt.data.dataset import load_dataset, unknown_summary
from jaxgpt.data.tokenizer import (
    WORD_PAD,
    WORD_PAD_ID,
    WORD_PUNCTUATION,
    WORD_UNK,
    WORD_UNK_ID,
    WordTokenizer,
    describe_tokenizer,
    same_tokenizer,
    standardize,
    tokenizer_from_meta,
)
from jaxgpt.errors import UserError
from jaxgpt.io import weights
from jaxgpt.model.config import ModelConfig

WINE_CSV = ROOT / "tests" / "data" / "wine_tiny.csv"
PROMPT = "wine review : germany"
# Unicode White_Space (each single one, and three of the range U+2000..U+200A): what standardization drops.
WHITE_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2005\u200a\u2028\u2029\u202f\u205f\u3000"
# Random text is drawn from these: ASCII letters and punctuation, accents, Greek (the final-sigma rule),
# a dotted capital I (lowers to two code points), separators that Python's \s knows but White_Space does not,
# digits, emoji, and the White_Space characters above.
ALPHABET = (string.ascii_letters + string.punctuation + string.digits + "éÉüÜßçÇñΣσςΟΔİ\x1c\x1f—’“🍷"
            + WHITE_SPACE)


def random_text(rng: random.Random, n_words: int, specials: bool = False) -> str:
    """Words from a small pool (so they repeat) mixed with random strings over ALPHABET."""
    pool = ["Wine", "review", "GERMANY", "riesling", "isn't", "dry,", "(mosel)", "Σοφία", "ΟΔΟΣ"]
    pieces = []
    for _ in range(n_words):
        r = rng.random()
        if r < 0.5:
            pieces.append(rng.choice(pool))
        elif specials and r < 0.6:
            pieces.append(rng.choice([WORD_PAD, WORD_UNK, "[pad]", "x[PAD]y"]))
        else:
            pieces.append("".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 8))))
        pieces.append(rng.choice(["", " ", "  ", "\n", "\t", "\u3000"]))
    return "".join(pieces)


def texts(seed: int, n: int = 50, specials: bool = False) -> list[str]:
    rng = random.Random(seed)
    return [random_text(rng, rng.randint(0, 40), specials) for _ in range(n)]


# ---------------------------------------------------------------------------------------------------
# The tokenizer


def test_punctuation_is_python_string_punctuation() -> None:
    matched = "".join(chr(c) for c in range(0x3000) if re.fullmatch(WORD_PUNCTUATION, chr(c)))
    assert matched == string.punctuation


def test_standardize_drops_only_whitespace_and_splits_punctuation() -> None:
    assert standardize("Isn't it DRY?!  (Mosel)") == ["isn", "'", "t", "it", "dry", "?", "!", "(", "mosel", ")"]
    for text in texts(seed=0):
        words = standardize(text)
        lowered = "".join(c.lower() for c in text)  # character by character, as the exported tokenizer lowers
        assert "".join(words) == "".join(c for c in lowered if c not in WHITE_SPACE)
        assert all(w and not any(c in WHITE_SPACE for c in w) for w in words)
        assert all(len(w) == 1 for w in words if any(c in string.punctuation for c in w))


def test_round_trips_on_random_text() -> None:
    """encode(decode(encode(x))) == encode(x) always; decode(encode(x)) is the standardized text when every
    word is known."""
    corpus = texts(seed=1)
    known = WordTokenizer.from_texts(corpus, vocab_size=10_000)
    small = WordTokenizer.from_texts(corpus, vocab_size=12)  # most words unknown
    for text in [*corpus, *texts(seed=2, specials=True)]:
        for tok in (known, small):
            ids = tok.encode(text)
            assert tok.encode(tok.decode(ids)) == ids
    for text in corpus:
        assert known.decode(known.encode(text)) == " ".join(standardize(text))
        assert WORD_UNK_ID not in known.encode(text)


def test_special_tokens_are_their_literal_text() -> None:
    tok = WordTokenizer.from_texts(["a b"], vocab_size=10)
    assert tok.encode(f"A{WORD_PAD}b {WORD_UNK} c") == [2, WORD_PAD_ID, 3, WORD_UNK_ID, WORD_UNK_ID]
    assert tok.decode([2, WORD_PAD_ID, WORD_UNK_ID]) == f"a {WORD_PAD} {WORD_UNK}"
    assert tok.encode("[pad]") == [WORD_UNK_ID] * 3  # only the exact literal is special
    assert tok.eot_token == WORD_PAD_ID and tok.unk_token == WORD_UNK_ID


def test_unknown_words_become_unk_and_are_named() -> None:
    tok = WordTokenizer.from_texts(["the wine is dry"], vocab_size=100)
    assert tok.encode("The wine is SWEET") == [tok.encode("the")[0], *tok.encode("wine is"), WORD_UNK_ID]
    assert tok.unknown_words("sweet wine, sweet!") == ["sweet", ",", "!"]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])


def test_vocabulary_is_by_frequency_capped_and_deterministic() -> None:
    corpus = texts(seed=3)
    counts = Counter(w for text in corpus for w in standardize(text))
    for size in (3, 10, 50, 10_000):
        tok = WordTokenizer.from_texts(corpus, vocab_size=size)
        assert tok.vocab_size == min(size, len(counts) + 2)
        assert tok.tokens[:2] == [WORD_PAD, WORD_UNK]
        ranks = [(-counts[w], w) for w in tok.words]
        assert ranks == sorted(ranks)  # most frequent first, ties in code-point order
        assert min(ranks, default=(0, ""))[0] <= -max((counts[w] for w in counts if w not in tok.words), default=0)
        shuffled = corpus[::-1]
        assert WordTokenizer.from_texts(shuffled, vocab_size=size).words == tok.words
    with pytest.raises(UserError, match="at least 3"):
        WordTokenizer.from_texts(corpus, vocab_size=2)
    with pytest.raises(UserError, match="no words"):
        WordTokenizer.from_texts(["  \n "], vocab_size=10)


def test_meta_round_trip_and_corrupt_meta() -> None:
    tok = WordTokenizer.from_texts(texts(seed=4), vocab_size=40)
    back = tokenizer_from_meta(json.loads(json.dumps(tok.to_meta())))
    assert isinstance(back, WordTokenizer) and back.tokens == tok.tokens
    sample = " ".join(texts(seed=5))
    assert back.encode(sample) == tok.encode(sample)
    for words in (["a", "a"], ["Capital"], ["two words"], ["a,"], [WORD_UNK], []):
        with pytest.raises(UserError, match="re-run data preparation"):
            tokenizer_from_meta({"type": "word", "words": words, "vocab_size": len(words) + 2})


def test_runs_compare_word_vocabularies() -> None:
    a, b = (WordTokenizer.from_texts(["red wine", t], vocab_size=10).to_meta() for t in ("dry", "sweet"))
    assert same_tokenizer(a, json.loads(json.dumps(a))) and not same_tokenizer(a, b)
    assert describe_tokenizer(a) == "a 5-word vocabulary"


# ---------------------------------------------------------------------------------------------------
# Data preparation


def test_prepared_text_counts_unknown_tokens(tmp_path: Path, capsys) -> None:
    corpus = texts(seed=6, n=20)
    files = []
    for i, text in enumerate(corpus):
        files.append(tmp_path / f"doc{i}.txt")
        files[-1].write_text(text + " filler words here", encoding="utf-8")
    out = tmp_path / "words"
    code = data_command.main(["jaxgpt data", "--text", *map(str, files), "--tokenizer", "word", "--vocab_size", "20",
                              "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    dataset = load_dataset(out)
    tok = dataset.tokenizer
    assert tok.vocab_size == 20 and dataset.meta["tokenizer"]["type"] == "word"
    expected = sum(w not in tok.words for f in files for w in standardize(f.read_text(encoding="utf-8")))
    assert dataset.meta["unknown_tokens"] == expected > 0
    train, val = np.asarray(dataset.train), np.asarray(dataset.val)
    assert int((train == WORD_UNK_ID).sum() + (val == WORD_UNK_ID).sum()) == expected
    assert (train == WORD_PAD_ID).sum() + (val == WORD_PAD_ID).sum() == len(files) - 1  # separators
    assert unknown_summary(dataset.meta) in printed and f"{expected:,} of" in printed and "%" in printed


def test_flags_that_do_not_apply_are_refused(tmp_path: Path, capsys) -> None:
    (tmp_path / "a.txt").write_text("some text")
    for extra in (["--vocab_size", "10"], ["--csv", str(WINE_CSV), "--tokenizer", "word"]):
        code = data_command.main(["jaxgpt data", "--text", str(tmp_path / "a.txt"), "--out", str(tmp_path / "o"),
                                  *extra])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1, err
    with pytest.raises(UserError, match="not of stdlib_char"):
        prepare_builtin("stdlib_char", tmp_path / "stdlib_char", csv_path=WINE_CSV)


def test_wine_csv_lines_as_the_article_builds_them() -> None:
    reviews, source = wine_reviews(WINE_CSV)
    assert reviews[0].startswith("wine review : Germany : Mosel : Riesling : Crisp green apple")
    assert all(r.count(" : ") >= 4 and r.startswith("wine review : ") for r in reviews)
    assert not any("Mystery" in r or "tart cherry" in r for r in reviews)  # no country / no variety: skipped
    assert "10 reviews, 2 rows skipped" in source


def test_wine_csv_missing_or_wrong_is_one_line(tmp_path: Path, capsys) -> None:
    for path in (tmp_path / "absent.csv", None):
        with pytest.raises(UserError) as e:
            prepare_builtin("wine_reviews", tmp_path / "wine_reviews", csv_path=path)
        message = str(e.value)
        assert "\n" not in message and "zynicide/wine-reviews" in message and "winemag-data-130k-v2.csv" in message
        assert "--config.data.csv" in message and "--csv" in message
    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    with pytest.raises(UserError, match="no country, province, variety, description column"):
        wine_reviews(tmp_path / "other.csv")
    code = train_command.main(["train.py", f"--config={ROOT / 'configs' / 'seed004.py'}",
                               f"--config.workdir={tmp_path / 'run'}", f"--config.data.dir={tmp_path / 'wine_reviews'}",
                               f"--config.data.csv={tmp_path / 'absent.csv'}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "zynicide/wine-reviews" in err, err
    assert not (tmp_path / "wine_reviews").exists()


# ---------------------------------------------------------------------------------------------------
# Sampling and export of a word-tokenized run; configs/seed004.py on the tiny CSV


@pytest.fixture(scope="module")
def wine_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "wine_reviews"
    prepare_builtin("wine_reviews", out, csv_path=WINE_CSV)
    return out


@pytest.fixture(scope="module")
def word_run(tmp_path_factory, wine_data: Path) -> Path:
    """A checkpoint of a small GPT-2-shaped model (so that it exports) with the tiny CSV's word tokenizer."""
    meta = load_dataset(wine_data).meta
    cfg = ModelConfig(vocab_size=meta["vocab_size"], block_size=32, n_layer=1, n_head=2, n_embd=16)
    return save_run(tmp_path_factory.mktemp("word_run"), cfg, random_params(cfg, seed=2), meta["tokenizer"])


def sample_words(run: Path, capsys, *extra: str) -> tuple[int, str, str]:
    code = sample_command.main(["jaxgpt sample", "--workdir", str(run), "--max_new_tokens", "8", "--temperature",
                                "0", *extra])
    out, err = capsys.readouterr()
    return code, out.removesuffix("\n"), err


def test_sampling_prints_words_after_the_prompt(word_run: Path, wine_data: Path, capsys) -> None:
    tok = load_dataset(wine_data).tokenizer
    code, out, err = sample_words(word_run, capsys, "--prompt", PROMPT)
    assert code == 0, err
    assert out.startswith(PROMPT + " ") or out == PROMPT
    assert all(w in tok.tokens for w in out.split(" "))  # decoded words, one space between them
    assert tok.encode(out)[:4] == tok.encode(PROMPT) and WORD_PAD_ID not in tok.encode(out)  # [PAD] ends a sample
    code, several, err = sample_words(word_run, capsys, "--prompt", PROMPT, "--num_samples", "2")
    assert code == 0 and several.splitlines()[0] == out, err  # printed as it streams or at the end: the same
    code, _, err = sample_words(word_run, capsys, "--prompt", "Wine review: Narnia")
    assert code == 2 and err.count("\n") == 1 and "'narnia'" in err, err


@pytest.mark.torch
def test_export_loads_in_transformers_with_the_same_ids(word_run: Path, wine_data: Path, tmp_path: Path,
                                                        capsys) -> None:
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    code = hf_command.main(["jaxgpt hf", "export", "--workdir", str(word_run), "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    capsys.readouterr()
    tok = load_dataset(wine_data).tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(str(out))
    for text in [*wine_reviews(WINE_CSV)[0], *texts(seed=7, n=30, specials=True)]:
        ids = tok.encode(text)
        assert theirs(text)["input_ids"] == ids, text
        assert theirs.decode(ids) == tok.decode(ids)
    assert weights.load(f"hf:{out}").tokenizer_meta == tok.to_meta()  # and back into jaxgpt
    pytest.importorskip("torch")
    code, ours, err = sample_words(word_run, capsys, "--prompt", PROMPT)
    assert code == 0, err
    # transformers 5's pipeline appends the new words' decoding to the prompt as it is, with no space between.
    generator = transformers.pipeline("text-generation", model=str(out), device="cpu")
    theirs = generator(PROMPT, do_sample=False, max_new_tokens=8, return_full_text=False)[0]["generated_text"]
    assert theirs and ours == f"{PROMPT} {theirs}"


@pytest.mark.slow
def test_seed004_recipe_trains_and_samples_on_the_tiny_csv(tmp_path: Path, capsys) -> None:
    """configs/seed004.py, the model shrunk: the CSV prepared on first use (its [UNK] line printed), a few steps,
    then `sample.py --prompt "wine review : germany"` from the run."""
    shrink = {"model.block_size": 16, "model.n_embd": 32, "model.head_dim": 16, "model.d_ff": 32, "batch_size": 4,
              "max_steps": 4, "eval_interval": 4, "eval_batches": 1, "log_interval": 2, "sample.max_new_tokens": 0,
              "compilation_cache_dir": "", "data.dir": tmp_path / "wine_reviews", "data.csv": WINE_CSV,
              "workdir": tmp_path / "run"}
    args = [f"--config.{k}={v}" for k, v in shrink.items()]
    assert train_command.main(["train.py", f"--config={ROOT / 'configs' / 'seed004.py'}", *args]) == 0
    assert "0 of " in capsys.readouterr().out  # every word of 10 reviews fits 10,000 words
    dataset = load_dataset(tmp_path / "wine_reviews")
    assert dataset.meta["tokenizer"]["type"] == "word" and "10 reviews" in dataset.meta["source"]
    loaded = weights.load(f"workdir:{tmp_path / 'run'}")
    assert loaded.tokenizer_meta == dataset.meta["tokenizer"] and loaded.model.vocab_size == dataset.meta["vocab_size"]
    code, out, err = sample_words(tmp_path / "run", capsys, "--prompt", PROMPT)
    assert code == 0 and out.startswith(PROMPT), err
