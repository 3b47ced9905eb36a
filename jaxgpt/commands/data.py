"""Prepare a jaxgpt dataset: a built-in corpus, or your own UTF-8 text files.

    jaxgpt data --dataset stdlib_char --out data/stdlib_char
    jaxgpt data --dataset shakespeare --out data/shakespeare [--bpe_file gpt2.tiktoken]
    jaxgpt data --dataset fineweb_edu --out data/fineweb_edu [--max_documents 100000]
    jaxgpt data --text a.txt b.txt --tokenizer char --out data/mine [--overwrite]
    jaxgpt data --text 'corpus/*.jsonl' --tokenizer gpt2 --out data/corpus --workers 8 [--text_field text]
    jaxgpt data --hf_dataset HuggingFaceFW/fineweb-edu:sample-10BT --tokenizer gpt2 --out data/edu
    jaxgpt data --text a.txt --tokenizer word --vocab_size 10000 --out data/mine_words
    jaxgpt data --text a.txt --tokenizer_from hf:path/to/Llama-3.2-1B --out data/mine_llama   # or gguf:smollm2
    jaxgpt data --dataset wine_reviews --csv winemag-data-130k-v2.csv --out data/wine_reviews

--text takes files, directories (every file below, sorted) and glob patterns, several after one --text or
one per --text, concatenated in order: .jsonl and .parquet files hold one document per record (the
--text_field column), any other file is one UTF-8 document. --workers processes tokenize in parallel into
token shards of --shard_tokens ids, written as they fill, so memory stays bounded for any corpus; the
shards are the same for any number of workers. Running the same command after an interruption resumes from
the completed shards. The last --val_fraction of the tokens becomes the validation split. One summary line is
printed when done, and for word tokens (--tokenizer word, wine_reviews) a second with how many tokens are the
unknown word. meta.json is written last and the dataset moved into place complete: a failure or a full disk
leaves nothing that looks prepared.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from absl import flags

from jaxgpt import storage
from jaxgpt.commands import no_arguments, run_command
from jaxgpt.data import remote
from jaxgpt.data.corpora import BUILTIN_DATASETS, WINE_VOCAB_SIZE, prepare_builtin
from jaxgpt.data.dataset import unknown_summary
from jaxgpt.data.prepare import SHARD_TOKENS, prepare, prepare_text
from jaxgpt.data.sources import hub_stream
from jaxgpt.data.tokenizer import Tokenizer, WordTokenizer, load_bpe, tokenizer_from_meta
from jaxgpt.errors import UserError

# The flags that name a file or directory, and what each takes (`storage.check`, before anything is read).
LOCATIONS = {"text": storage.LOCAL, "out": storage.ANYWHERE, "csv": storage.LOCAL, "bpe_file": storage.LOCAL}


def define(flags_: flags.FlagValues, argv: Sequence[str]) -> None:
    flags.DEFINE_enum("dataset", None, BUILTIN_DATASETS, "a built-in dataset", flag_values=flags_)
    flags.DEFINE_multi_string("text", None, "UTF-8 text files, concatenated in order", flag_values=flags_)
    flags.DEFINE_string("hf_dataset", None, "a Hugging Face Hub dataset to stream: REPO or REPO:CONFIG (its train "
                        "split's --text_field)", flag_values=flags_)
    flags.mark_flags_as_mutual_exclusive(["dataset", "text", "hf_dataset"], required=True, flag_values=flags_)
    flags.DEFINE_string("text_field", "text", "the text column of .jsonl / .parquet files and --hf_dataset",
                        flag_values=flags_)
    flags.DEFINE_integer("workers", os.cpu_count() or 1, "tokenizing processes (default: the cores)",
                         lower_bound=1, flag_values=flags_)
    flags.DEFINE_integer("shard_tokens", SHARD_TOKENS, "ids per token shard file", lower_bound=1, flag_values=flags_)
    flags.DEFINE_enum("tokenizer", "char", ("char", "gpt2", "cl100k_base", "o200k_base", "word"), "a character "
                      "vocabulary of the text, GPT-2's BPE, tiktoken's larger BPEs (uint32 ids), or seed 004's words "
                      "(lower-cased, punctuation split off)", flag_values=flags_)
    flags.DEFINE_string("tokenizer_from", None, "instead of --tokenizer, the tokenizer of these weights (hf:DIR, "
                        "gguf:PATH or NAME, workdir:RUN): continued pretraining of that model on your text",
                        flag_values=flags_)
    flags.DEFINE_integer("vocab_size", None, f"word tokens: keep the most frequent words, [PAD] and [UNK] included "
                         f"(default {WINE_VOCAB_SIZE})", flag_values=flags_)
    flags.DEFINE_string("csv", None, "wine_reviews: Kaggle's winemag-data-130k-v2.csv", flag_values=flags_)
    flags.DEFINE_string("out", None, "output directory", flag_values=flags_)
    flags.mark_flag_as_required("out", flag_values=flags_)
    flags.DEFINE_bool("overwrite", False, "replace an existing different dataset, or token files without a "
                      "meta.json (never done otherwise; the same tokens again leave a dataset untouched)",
                      flag_values=flags_)
    flags.DEFINE_float("val_fraction", 0.1, "last fraction of the tokens for validation", flag_values=flags_)
    flags.DEFINE_string("bpe_file", None, "the BPE ranks file when offline: gpt2.tiktoken (else $JAXGPT_BPE_FILE), "
                        "cl100k_base.tiktoken or o200k_base.tiktoken",
                        flag_values=flags_)
    flags.DEFINE_integer("max_documents", None, "openwebtext, fineweb_edu, --hf_dataset: stop after this many "
                         "documents", flag_values=flags_)


def run(flags_: flags.FlagValues, args: list[str]) -> None:
    """Prepare into --out; a bucket --out is prepared locally (`remote.local_copy`) and then published."""
    started = time.perf_counter()
    out = flags_.out
    if storage.is_bucket(out):
        remote.check_may_publish(out, flags_.overwrite)
        out = str(remote.local_copy(out))
    meta = _prepare(flags_, args, out)
    if out != flags_.out:
        remote.publish(Path(out), flags_.out, flags_.overwrite)
    print(f"{flags_.out}: {meta['n_train']} train + {meta['n_val']} val tokens, vocab {meta['vocab_size']} "
          f"({meta['tokenizer']['type']}), {time.perf_counter() - started:.1f}s; {meta['source']}")
    if unknown := unknown_summary(meta):
        print(unknown)


def _prepare(flags_: flags.FlagValues, args: list[str], out: str) -> dict:
    # A bucket's local copy is this command's own cache: replacing what an earlier call left there is fine.
    overwrite = flags_.overwrite or out != flags_.out
    if flags_.dataset:
        no_arguments(args)
        return prepare_builtin(flags_.dataset, out, overwrite=overwrite,
                               val_fraction=flags_.val_fraction, bpe_file=flags_.bpe_file,
                               max_documents=flags_.max_documents, csv_path=flags_.csv, vocab_size=flags_.vocab_size,
                               workers=flags_.workers)
    if flags_.csv is not None or (flags_.vocab_size is not None and flags_.tokenizer != "word"):
        raise UserError("--csv goes with --dataset wine_reviews and --vocab_size with --tokenizer word: drop it")
    tokenizer = None  # char: the text's own characters
    if flags_.tokenizer_from is not None:
        tokenizer = _model_tokenizer(flags_)
    elif flags_.tokenizer not in ("char", "word"):
        tokenizer = load_bpe(flags_.tokenizer, flags_.bpe_file)
    elif flags_.tokenizer == "word":
        words = WINE_VOCAB_SIZE if flags_.vocab_size is None else flags_.vocab_size
        tokenizer = functools.partial(WordTokenizer.from_texts, vocab_size=words)
    options = {"val_fraction": flags_.val_fraction, "overwrite": overwrite, "workers": flags_.workers,
               "shard_tokens": flags_.shard_tokens, "bpe_file": flags_.bpe_file}
    if flags_.hf_dataset:
        no_arguments(args)
        repo, _, config = flags_.hf_dataset.partition(":")
        return prepare(lambda: hub_stream(repo, config or None, flags_.text_field, flags_.max_documents),
                       out, tokenizer, source=f"{flags_.hf_dataset} (Hugging Face Hub)", **options)
    # `--text a.txt b.txt`: the files after the first arrive as positional arguments.
    for path in args:
        storage.check(path, "--text", storage.LOCAL)
    paths = [Path(p) for p in [*flags_.text, *args]]
    return prepare_text(paths, out, tokenizer, text_field=flags_.text_field, **options)


def _model_tokenizer(flags_: flags.FlagValues) -> Tokenizer:
    """The tokenizer of --tokenizer_from's weights (read without their tensors), which --tokenizer must not name."""
    from jaxgpt.io import weights

    if flags_["tokenizer"].present:
        raise UserError("--tokenizer and --tokenizer_from both name a tokenizer: give one")
    meta = weights.describe(flags_.tokenizer_from)[1]
    if meta is None:
        raise UserError(f"--tokenizer_from={flags_.tokenizer_from} has no tokenizer of its own: give --tokenizer")
    return tokenizer_from_meta(meta, flags_.bpe_file)


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(__doc__, define, run, argv, LOCATIONS)


if __name__ == "__main__":
    sys.exit(main())
