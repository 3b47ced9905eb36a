"""The built-in datasets: the interpreter's standard library, tiny Shakespeare, a Hub web-text corpus, and
seed 004's wine reviews (from a local copy of Kaggle's CSV, which needs a login to download).

Each is turned into a prepared dataset (`jaxgpt.data.dataset`'s format) by `prepare_builtin`; the command line
is `jaxgpt data --dataset NAME --out DIR`. stdlib_char needs no network: it reads the running
interpreter's own standard library, so every machine with Python has it.
"""

from __future__ import annotations

import csv
import functools
import http.client
import os
import platform
import sysconfig
import urllib.request
from pathlib import Path
from typing import Any

from jaxgpt.data.dataset import META_FILE
from jaxgpt.data.prepare import prepare, prepare_text
from jaxgpt.data.sources import hub_stream
from jaxgpt.data.tokenizer import Tokenizer, WordTokenizer, load_bpe
from jaxgpt.errors import UserError

BUILTIN_DATASETS = ("stdlib_char", "shakespeare_char", "shakespeare", "openwebtext", "fineweb_edu", "wine_reviews")
# Directories of the standard library that are not "library code": test suites, third-party packages and
# bytecode caches (lib2to3/tests, idlelib/idle_test, unittest/test, ... are all matched by name).
STDLIB_EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "__pycache__", "site-packages", "dist-packages"}
)
SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
DOWNLOAD_TIMEOUT_S = 15.0
# Web text streamed from the Hub: parquet shards that `datasets` streams without a loading script (the
# original Skylion007/openwebtext needs one, which recent `datasets` releases no longer run). "openwebtext"
# keeps its name for configs that use it; fineweb_edu is FineWeb's educational subset, which trains GPT-2
# sizes to a higher HellaSwag score per token. Offline, the same parquet files prepare with --text.
HUB_CORPORA = {"openwebtext": ("HuggingFaceFW/fineweb", "sample-10BT"),
               "fineweb_edu": ("HuggingFaceFW/fineweb-edu", "sample-10BT")}
# Seed 004: the columns each review line is built from, in line order, and the article's vocabulary size.
WINE_FIELDS = ("country", "province", "variety", "description")
WINE_VOCAB_SIZE = 10000
WINE_CSV_HELP = ("download winemag-data-130k-v2.csv from https://www.kaggle.com/datasets/zynicide/wine-reviews "
                 "(Kaggle needs a login, so jaxgpt cannot fetch it) and pass its path with --config.data.csv=PATH "
                 "(training) or --csv PATH (jaxgpt data --dataset wine_reviews)")


def stdlib_root() -> Path:
    """The running interpreter's standard library (for a venv: the base installation's)."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path) -> list[str]:
    """Relative POSIX paths of the library's .py files, sorted so the corpus order never depends on the
    file system's directory order."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in STDLIB_EXCLUDED_DIRS]
        rel_dir = Path(dirpath).relative_to(root)
        found += [(rel_dir / name).as_posix() for name in filenames if name.endswith(".py")]
    return sorted(found)


def stdlib_corpus(root: Path) -> tuple[str, str]:
    """(corpus text, description) of the .py sources under `root`: each file's text after a
    `# file: relative/path.py` line, files separated by a newline. Files that are not valid UTF-8 are
    skipped (the same ones every time), since a character model should not learn decoding garbage."""
    parts, skipped = [], 0
    files = stdlib_files(root)
    for rel in files:
        try:
            text = (root / rel).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            skipped += 1
            continue
        parts.append(f"# file: {rel}\n{text}")
    if not parts:
        raise UserError(f"no Python sources found under {root}: this interpreter has no standard library "
                        "sources; prepare a text file instead (--text FILE --tokenizer char)")
    description = (f"Python {platform.python_version()} standard library at {root}: {len(parts)} .py files"
                   f" ({skipped} skipped as not UTF-8), tests and site-packages excluded")
    return "\n".join(parts), description


def wine_reviews(csv_path: str | os.PathLike[str]) -> tuple[list[str], str]:
    """(one document per review, description) from Kaggle's winemag-data-130k-v2.csv, as seed 004 builds them:
    "wine review : {country} : {province} : {variety} : {description}". Rows lacking any of those four fields
    are skipped, as the article's recipe does, and counted in the description."""
    path = Path(csv_path)
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            missing = [field for field in WINE_FIELDS if field not in (reader.fieldnames or ())]
            if missing:
                raise UserError(f"{path} has no {', '.join(missing)} column(s), so it is not Kaggle's wine-reviews "
                                f"CSV: {WINE_CSV_HELP}")
            rows = [[(row.get(field) or "").strip() for field in WINE_FIELDS] for row in reader]
    except FileNotFoundError:
        raise UserError(f"wine-reviews CSV {path} not found: {WINE_CSV_HELP}") from None
    except OSError as e:
        raise UserError(f"cannot read wine-reviews CSV {path} ({e.strerror}): check the path") from None
    except (UnicodeDecodeError, csv.Error) as e:
        raise UserError(f"{path} is not a UTF-8 CSV file ({e}): {WINE_CSV_HELP}") from None
    reviews = [f"wine review : {' : '.join(fields)}" for fields in rows if all(fields)]
    if not reviews:
        raise UserError(f"{path} has no row with all of {', '.join(WINE_FIELDS)}: {WINE_CSV_HELP}")
    description = (f"wine reviews {path}: {len(reviews)} reviews, {len(rows) - len(reviews)} rows skipped for a "
                   f"missing {', '.join(WINE_FIELDS[:-1])} or {WINE_FIELDS[-1]}")
    return reviews, description


def download(url: str, dest: Path, fallback_hint: str) -> Path:
    """Fetch `url` to `dest` once (atomically: a partial download never sits at `dest`)."""
    if dest.is_file():
        return dest
    try:
        with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response:
            data = response.read()
    except (OSError, http.client.HTTPException) as e:  # URLError, HTTPError and timeouts are OSErrors
        raise UserError(f"download of {url} failed ({e}): {fallback_hint}") from e
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    partial.write_bytes(data)
    os.replace(partial, dest)
    return dest


def _prepare_hub(name: str, out_dir: Path, tokenizer: Tokenizer, *, val_fraction: float, overwrite: bool,
                 max_documents: int | None, workers: int) -> dict[str, Any]:
    """Tokenize a Hub corpus as it streams, in parallel (`jaxgpt.data.prepare`); `max_documents` caps it."""
    if (out_dir / META_FILE).exists() and not overwrite:
        # Comparing contents would mean streaming the whole corpus first: refuse up front instead.
        raise UserError(f"{out_dir} already holds a dataset: pass --overwrite (overwrite=True) to replace "
                        "it, or choose another output directory")
    repo, config = HUB_CORPORA[name]
    limit = "all documents" if max_documents is None else f"first {max_documents} documents"
    return prepare(lambda: hub_stream(repo, config, max_documents=max_documents), out_dir, tokenizer,
                   val_fraction=val_fraction, source=f"{repo} ({config}), {limit}", overwrite=overwrite,
                   workers=workers)


def prepare_builtin(
    name: str,
    out_dir: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    val_fraction: float = 0.1,
    bpe_file: str | os.PathLike[str] | None = None,
    max_documents: int | None = None,
    csv_path: str | os.PathLike[str] | None = None,
    vocab_size: int | None = None,
    workers: int = 1,
) -> dict[str, Any]:
    """Prepare one of `BUILTIN_DATASETS` in `out_dir` and return its meta.

    stdlib_char needs no download (the interpreter's own library sources, character-level);
    shakespeare_char / shakespeare download tiny Shakespeare (char / GPT-2 BPE); openwebtext and fineweb_edu
    stream web text through the Hugging Face `datasets` package (GPT-2 BPE; `max_documents` caps it; `workers`
    processes tokenize);
    wine_reviews reads Kaggle's CSV at `csv_path` into words (`vocab_size`, default the article's 10000), one
    review per document with the [PAD] token between them.
    """
    out = Path(out_dir)
    if name != "wine_reviews" and (csv_path or vocab_size is not None):
        raise UserError(f"a CSV path and a vocabulary size are settings of wine_reviews, not of {name}: drop them")
    if name == "wine_reviews":
        if not csv_path:
            raise UserError(f"wine_reviews is built from Kaggle's CSV: {WINE_CSV_HELP}")
        reviews, source = wine_reviews(csv_path)
        words = WINE_VOCAB_SIZE if vocab_size is None else vocab_size
        build = functools.partial(WordTokenizer.from_texts, vocab_size=words)
        return prepare_text(reviews, out, build, val_fraction, source, overwrite)
    if name == "stdlib_char":
        text, source = stdlib_corpus(stdlib_root())
        return prepare_text([text], out, None, val_fraction, source, overwrite)
    if name in ("shakespeare_char", "shakespeare"):
        kind = "char" if name == "shakespeare_char" else "gpt2"
        hint = f"fetch it elsewhere, then run `jaxgpt data --text input.txt --tokenizer {kind} --out {out}`"
        path = download(SHAKESPEARE_URL, out / "input.txt", hint)
        tokenizer = None if kind == "char" else load_bpe("gpt2", bpe_file)
        return prepare_text([path], out, tokenizer, val_fraction, f"tiny shakespeare ({SHAKESPEARE_URL})",
                            overwrite)
    if name in HUB_CORPORA:
        return _prepare_hub(name, out, load_bpe("gpt2", bpe_file), val_fraction=val_fraction, overwrite=overwrite,
                            max_documents=max_documents, workers=workers)
    raise UserError(f"unknown dataset {name!r}: use one of {', '.join(BUILTIN_DATASETS)}, or --text FILE...")
