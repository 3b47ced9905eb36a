"""Prepare a jaxgpt dataset: a built-in corpus, or your own UTF-8 text files.

    jaxgpt data --dataset stdlib_char --out data/stdlib_char
    jaxgpt data --dataset shakespeare --out data/shakespeare [--bpe_file gpt2.tiktoken]
    jaxgpt data --text a.txt b.txt --tokenizer char --out data/mine [--overwrite]

Files given to --text (several after one --text, or one per --text) are concatenated in order; the last
--val_fraction of the tokens becomes the validation split. One summary line is printed when done. The dataset
is written into a temporary directory and moved into place complete: a failure or a full disk leaves nothing
that looks prepared.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

from absl import flags

from jaxgpt.commands import no_arguments, run_command
from jaxgpt.data import prepare_text
from jaxgpt.datasets import BUILTIN_DATASETS, prepare_builtin
from jaxgpt.tokenizer import load_bpe


def define(flags_: flags.FlagValues, argv: Sequence[str]) -> None:
    flags.DEFINE_enum("dataset", None, BUILTIN_DATASETS, "a built-in dataset", flag_values=flags_)
    flags.DEFINE_multi_string("text", None, "UTF-8 text files, concatenated in order", flag_values=flags_)
    flags.mark_flags_as_mutual_exclusive(["dataset", "text"], required=True, flag_values=flags_)
    flags.DEFINE_enum("tokenizer", "char", ("char", "gpt2"), "for --text: a character vocabulary of the "
                      "text, or GPT-2's BPE", flag_values=flags_)
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
                               max_documents=flags_.max_documents)
    else:
        # `--text a.txt b.txt`: the files after the first arrive as positional arguments.
        paths = [Path(p) for p in [*flags_.text, *args]]
        tokenizer = None if flags_.tokenizer == "char" else load_bpe("gpt2", flags_.bpe_file)
        meta = prepare_text(paths, flags_.out, tokenizer, flags_.val_fraction, overwrite=flags_.overwrite)
    print(f"{flags_.out}: {meta['n_train']} train + {meta['n_val']} val tokens, vocab {meta['vocab_size']} "
          f"({meta['tokenizer']['type']}), {time.perf_counter() - started:.1f}s; {meta['source']}")


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(__doc__, define, run, argv)


if __name__ == "__main__":
    sys.exit(main())
