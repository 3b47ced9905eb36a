"""Prepare a jaxgpt dataset: a built-in corpus, or your own UTF-8 text files.

    jaxgpt data --dataset stdlib_char --out data/stdlib_char
    jaxgpt data --dataset shakespeare --out data/shakespeare [--bpe_file gpt2.tiktoken]
    jaxgpt data --text a.txt b.txt --tokenizer char --out data/mine [--overwrite]
    jaxgpt data --text a.txt --tokenizer word --vocab_size 10000 --out data/mine_words
    jaxgpt data --dataset wine_reviews --csv winemag-data-130k-v2.csv --out data/wine_reviews

Files given to --text (several after one --text, or one per --text) are concatenated in order; the last
--val_fraction of the tokens becomes the validation split. One summary line is printed when done, and for word
tokens (--tokenizer word, wine_reviews) a second with how many tokens are the unknown word. The dataset
is written into a temporary directory and moved into place complete: a failure or a full disk leaves nothing
that looks prepared.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from absl import flags

from jaxgpt.commands import no_arguments, run_command
from jaxgpt.data.corpora import BUILTIN_DATASETS, WINE_VOCAB_SIZE, prepare_builtin
from jaxgpt.data.dataset import prepare_text, unknown_summary
from jaxgpt.data.tokenizer import WordTokenizer, load_bpe
from jaxgpt.errors import UserError


def define(flags_: flags.FlagValues, argv: Sequence[str]) -> None:
    flags.DEFINE_enum("dataset", None, BUILTIN_DATASETS, "a built-in dataset", flag_values=flags_)
    flags.DEFINE_multi_string("text", None, "UTF-8 text files, concatenated in order", flag_values=flags_)
    flags.mark_flags_as_mutual_exclusive(["dataset", "text"], required=True, flag_values=flags_)
    flags.DEFINE_enum("tokenizer", "char", ("char", "gpt2", "word"), "for --text: a character vocabulary of the "
                      "text, GPT-2's BPE, or seed 004's words (lower-cased, punctuation split off)", flag_values=flags_)
    flags.DEFINE_integer("vocab_size", None, f"word tokens: keep the most frequent words, [PAD] and [UNK] included "
                         f"(default {WINE_VOCAB_SIZE})", flag_values=flags_)
    flags.DEFINE_string("csv", None, "wine_reviews: Kaggle's winemag-data-130k-v2.csv", flag_values=flags_)
    flags.DEFINE_string("out", None, "output directory", flag_values=flags_)
    flags.mark_flag_as_required("out", flag_values=flags_)
    flags.DEFINE_bool("overwrite", False, "replace an existing different dataset, or token files without a "
                      "meta.json (never done otherwise; the same tokens again leave a dataset untouched)",
                      flag_values=flags_)
    flags.DEFINE_float("val_fraction", 0.1, "last fraction of the tokens for validation", flag_values=flags_)
    flags.DEFINE_string("bpe_file", None, "GPT-2 ranks file (gpt2.tiktoken); else $JAXGPT_BPE_FILE",
                        flag_values=flags_)
    flags.DEFINE_integer("max_documents", None, "openwebtext: stop after this many documents", flag_values=flags_)


def run(flags_: flags.FlagValues, args: list[str]) -> None:
    started = time.perf_counter()
    if flags_.dataset:
        no_arguments(args)
        meta = prepare_builtin(flags_.dataset, flags_.out, overwrite=flags_.overwrite,
                               val_fraction=flags_.val_fraction, bpe_file=flags_.bpe_file,
                               max_documents=flags_.max_documents, csv_path=flags_.csv, vocab_size=flags_.vocab_size)
    else:
        if flags_.csv is not None or (flags_.vocab_size is not None and flags_.tokenizer != "word"):
            raise UserError("--csv goes with --dataset wine_reviews and --vocab_size with --tokenizer word: drop it")
        # `--text a.txt b.txt`: the files after the first arrive as positional arguments.
        paths = [Path(p) for p in [*flags_.text, *args]]
        tokenizer = None  # char: the text's own characters
        if flags_.tokenizer == "gpt2":
            tokenizer = load_bpe("gpt2", flags_.bpe_file)
        elif flags_.tokenizer == "word":
            words = WINE_VOCAB_SIZE if flags_.vocab_size is None else flags_.vocab_size
            tokenizer = functools.partial(WordTokenizer.from_texts, vocab_size=words)
        meta = prepare_text(paths, flags_.out, tokenizer, flags_.val_fraction, overwrite=flags_.overwrite)
    print(f"{flags_.out}: {meta['n_train']} train + {meta['n_val']} val tokens, vocab {meta['vocab_size']} "
          f"({meta['tokenizer']['type']}), {time.perf_counter() - started:.1f}s; {meta['source']}")
    if unknown := unknown_summary(meta):
        print(unknown)


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(__doc__, define, run, argv)


if __name__ == "__main__":
    sys.exit(main())
