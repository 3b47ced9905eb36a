"""Evaluate a model: loss, perplexity, bits per token and bits per character over a whole text or dataset.

    jaxgpt eval --workdir runs/mine --text notes.txt more.txt       # every token of the files
    jaxgpt eval --workdir runs/mine                                 # the run's dataset, whole validation split
    jaxgpt eval --workdir runs/mine --trainer_batches               # exactly the batches behind the logged val_loss
    jaxgpt eval --init_from hf:openai-community/gpt2 --text notes.txt
    jaxgpt eval --workdir runs/mine --benchmark hellaswag [--data hellaswag_val.jsonl] [--limit 1000]
    jaxgpt eval --workdir runs/mine --benchmark lambada [--data lambada_test.jsonl]

Text files are tokenized with the model's tokenizer and joined as `jaxgpt data` joins them (end-of-text
between files for GPT-2 BPE, which also starts the text, so that its first token is predicted). A text or
a split is covered by non-overlapping windows of the model's block_size, the last one partial, so every
token is predicted exactly once. `--trainer_batches` instead rebuilds the trainer's fixed evaluation
batches from the run's saved config (seed, batch size, eval_batches), so its loss is the trainer's
`val_loss` (or `train_loss` with --split train). A progress bar runs on stderr; the result is one line.

`--benchmark hellaswag` / `--benchmark lambada` score a benchmark instead (`jaxgpt.evals.benchmarks`): its JSONL
is downloaded once into $JAXGPT_CACHE (~/.cache/jaxgpt), or given with --data on an offline machine. `--task
NAME`, this flag's old name, still works and says once that it is deprecated ("task" is what `jaxgpt train` trains).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
from absl import flags

from jaxgpt import storage
from jaxgpt.commands import run_command
from jaxgpt.data.tokenizer import Tokenizer
from jaxgpt.data.user_files import read_text
from jaxgpt.errors import UserError
from jaxgpt.evals import benchmarks, text
from jaxgpt.io import weights

# The flags that name a file or directory, and what each takes (`storage.check`, before anything is read).
LOCATIONS = {"workdir": storage.ANYWHERE, "init_from": storage.SOURCE, "text": storage.LOCAL,
             "data_dir": storage.ANYWHERE, "data": storage.LOCAL, "bpe_file": storage.LOCAL}


def define(flags_: flags.FlagValues, argv: Sequence[str]) -> None:
    flags.DEFINE_string("workdir", None, "a jaxgpt run to evaluate", flag_values=flags_)
    flags.DEFINE_string("init_from", None, "or weights from elsewhere: hf:PATH, hf:OWNER/NAME, gguf:PATH, "
                        "peft:DIR, preset:NAME",
                        flag_values=flags_)
    flags.mark_flags_as_mutual_exclusive(["workdir", "init_from"], required=True, flag_values=flags_)
    flags.DEFINE_enum("which", "latest", ("latest", "best"), "which checkpoint of --workdir", flag_values=flags_)
    flags.DEFINE_multi_string("text", [], "UTF-8 text files to evaluate on (several after one --text, or one "
                              "per --text)", flag_values=flags_)
    flags.DEFINE_string("data_dir", None, "a prepared dataset (default: the run's config.data.dir)", flag_values=flags_)
    flags.DEFINE_enum("split", "val", ("val", "train"), "the dataset split to evaluate", flag_values=flags_)
    flags.DEFINE_bool("trainer_batches", False, "evaluate the trainer's evaluation batches of --split instead of "
                      "the whole split", flag_values=flags_)
    flags.DEFINE_integer("batch_size", 8, "windows per forward pass", flag_values=flags_)
    flags.DEFINE_integer("block_size", None, "window length (default: the model's block_size; shorter windows "
                         "compare models of different contexts on equal terms)", flag_values=flags_)
    flags.DEFINE_enum("benchmark", None, benchmarks.BENCHMARKS, "score a benchmark instead of the loss on text or a "
                      "dataset", flag_values=flags_)
    flags.DEFINE_enum("task", None, ("text", *benchmarks.BENCHMARKS), "deprecated: --benchmark", flag_values=flags_)
    flags.DEFINE_string("data", None, "the benchmark's JSONL (default: downloaded into $JAXGPT_CACHE, ~/.cache/jaxgpt)",
                        flag_values=flags_)
    flags.DEFINE_integer("limit", None, "score only the benchmark's first N examples", flag_values=flags_)
    flags.DEFINE_string("bpe_file", None, "local GPT-2 ranks file (gpt2.tiktoken) for BPE models", flag_values=flags_)


def read_texts(paths: Sequence[str]) -> list[str]:
    texts = []
    for path in paths:
        storage.check(path, "--text", storage.LOCAL)  # (also the files after the first, given as arguments)
        texts.append(read_text(path, "--text"))
    return texts


def window_length(flags_: flags.FlagValues, model_block_size: int) -> int:
    if flags_.block_size is None:
        return model_block_size
    if not 1 <= flags_.block_size <= model_block_size:
        raise UserError(f"--block_size={flags_.block_size} must be in 1..{model_block_size} (the model's context)")
    return flags_.block_size


def dataset_rows(flags_: flags.FlagValues, loaded: weights.Weights,
                 tokenizer: Tokenizer) -> tuple[text.Rows, int, str]:
    """Rows of a prepared dataset's split (whole, or the trainer's batches), their characters, and a label."""
    from jaxgpt.data.dataset import load_dataset
    from jaxgpt.data.tokenizer import describe_tokenizer, same_tokenizer

    settings = loaded.meta.get("config") or {}
    data_dir = flags_.data_dir or settings.get("data", {}).get("dir")
    if not data_dir:
        raise UserError("nothing to evaluate on: give --text FILE... or --data_dir DIR (a prepared dataset)")
    dataset = load_dataset(data_dir, bpe_file=flags_.bpe_file)
    if not same_tokenizer(dataset.meta["tokenizer"], tokenizer.to_meta()):
        raise UserError(f"{data_dir} uses {describe_tokenizer(dataset.meta['tokenizer'])}, the model "
                        f"{describe_tokenizer(tokenizer.to_meta())}: evaluate on data prepared with the model's "
                        "tokenizer")
    tokens = getattr(dataset, flags_.split)
    if flags_.trainer_batches:
        if not settings:
            raise UserError("--trainer_batches needs a run's saved config: use --workdir")
        rows = text.trainer_batches(tokens, settings, loaded.model.block_size, flags_.split)
        return rows, text.rows_characters(rows, tokenizer), f"{data_dir} ({flags_.split}, the trainer's batches)"
    ids = np.asarray(tokens, np.int64)
    rows = text.windows(ids, window_length(flags_, loaded.model.block_size))
    return rows, text.stream_characters(ids, tokenizer), f"{data_dir} ({flags_.split})"


def benchmark_name(flags_: flags.FlagValues) -> str | None:
    """--benchmark, or the deprecated --task it replaced (saying so, once); None: the loss on text or a dataset."""
    if flags_.task is None:
        return flags_.benchmark
    old = None if flags_.task == "text" else flags_.task
    if flags_.benchmark is not None and flags_.benchmark != old:
        raise UserError(f"--task={flags_.task} and --benchmark={flags_.benchmark} disagree: give --benchmark only")
    print(f"warning: --task is deprecated: use {f'--benchmark {old}' if old else 'no flag (text is the default)'}",
          file=sys.stderr)
    return old


def run_benchmark(flags_: flags.FlagValues, name: str, source: str, paths: list[str]) -> None:
    if paths or flags_.data_dir or flags_.trainer_batches:
        raise UserError(f"--benchmark {name} scores its own data: leave out --text, --data_dir and "
                        "--trainer_batches (give its JSONL with --data)")
    data = benchmarks.data_file(name, flags_.data)  # before the model is read
    loaded = weights.load(source, which=flags_.which)
    cfg = weights.require_gpt(source, loaded.model, f"be evaluated on {name}")
    result = benchmarks.evaluate(name, loaded.params, cfg, loaded.tokenizer(flags_.bpe_file), data,
                                 flags_.batch_size, flags_.limit)
    print(result.report())


def run(flags_: flags.FlagValues, args: list[str]) -> None:
    paths = [*flags_.text, *args]  # `--text a.txt b.txt`: the files after the first arrive as arguments
    if args and not flags_.text:
        raise UserError(f"unexpected arguments {args}: every setting is a --flag (see --help)")
    if flags_.trainer_batches and (paths or flags_.block_size is not None):
        raise UserError("--trainer_batches evaluates the run's own batches of a prepared dataset: leave out --text "
                        "and --block_size")
    source = weights.source_of(flags_.workdir, flags_.init_from)
    if name := benchmark_name(flags_):
        return run_benchmark(flags_, name, source, paths)
    texts = read_texts(paths)  # a wrong path fails before a model is read
    loaded = weights.load(source, which=flags_.which)
    weights.require_gpt(source, loaded.model, "be evaluated as a language model")
    tokenizer = loaded.tokenizer(flags_.bpe_file)
    if texts:
        ids = text.text_ids(texts, tokenizer)
        rows = text.windows(ids, window_length(flags_, loaded.model.block_size))
        characters = text.stream_characters(ids, tokenizer)
        label = ", ".join(paths)
    else:
        rows, characters, label = dataset_rows(flags_, loaded, tokenizer)
    result = text.evaluate(loaded.params, loaded.model, rows, characters, flags_.batch_size)
    print(f"{label}: {result.report()}")


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(__doc__, define, run, argv, LOCATIONS)


if __name__ == "__main__":
    sys.exit(main())
