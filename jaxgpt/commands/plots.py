"""Figures of a run: training curves, and the attention heatmaps of one layer for a prompt.

    jaxgpt plots curves --workdir DIR --out curves.png [--title T]
    jaxgpt plots attention --workdir DIR --prompt "Hello there" --layer 0 --out attn.png [--which best]
    jaxgpt plots attention --hf PATH --prompt "Hello there" --layer 5 --out attn.png [--bpe_file gpt2.tiktoken]
    jaxgpt plots attention --hf PATH --ids 464,2068,7586 --layer -1 --out attn.png

The sub-command comes first; `jaxgpt plots SUBCOMMAND --help` lists its flags. A run's tokenizer labels
the tokens; a Hugging Face directory with GPT-2's vocabulary is read with GPT-2's BPE, and --ids are shown
as numbers when the directory has no tokenizer.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from absl import flags

from jaxgpt import weights
from jaxgpt.commands import no_arguments, run_command
from jaxgpt.errors import UserError
from jaxgpt.plots import attention_maps, plot_attention, plot_training_curves, read_metrics, token_labels
from jaxgpt.tokenizer import Tokenizer

SUBCOMMANDS = ("curves", "attention")


def define(flags_: flags.FlagValues, argv: Sequence[str]) -> None:
    """Only the flags of the sub-command named first."""
    sub = argv[1] if len(argv) > 1 else None
    if sub not in SUBCOMMANDS:
        return
    flags.DEFINE_string("out", None, "PNG file to write", flag_values=flags_)
    flags.mark_flag_as_required("out", flag_values=flags_)
    if sub == "curves":
        flags.DEFINE_string("workdir", None, "a training work directory (with metrics.jsonl)", flag_values=flags_)
        flags.mark_flag_as_required("workdir", flag_values=flags_)
        flags.DEFINE_string("title", "", "figure title (default: the work directory's name)", flag_values=flags_)
        return
    flags.DEFINE_string("workdir", None, "a training work directory (its checkpoint)", flag_values=flags_)
    flags.DEFINE_string("hf", None, "a Hugging Face GPT-2 checkpoint directory", flag_values=flags_)
    flags.mark_flags_as_mutual_exclusive(["workdir", "hf"], required=True, flag_values=flags_)
    flags.DEFINE_string("prompt", None, "text to tokenize", flag_values=flags_)
    flags.DEFINE_string("ids", None, "token ids instead of text, e.g. '464,2068,7586'", flag_values=flags_)
    flags.mark_flags_as_mutual_exclusive(["prompt", "ids"], required=True, flag_values=flags_)
    flags.DEFINE_integer("layer", None, "layer index (0-based; -1 = last)", flag_values=flags_)
    flags.mark_flag_as_required("layer", flag_values=flags_)
    flags.DEFINE_enum("which", "latest", ("latest", "best"), "checkpoint of --workdir", flag_values=flags_)
    flags.DEFINE_string("bpe_file", None, "GPT-2 BPE ranks file when offline", flag_values=flags_)


def load(flags_: flags.FlagValues) -> tuple[weights.Weights, Tokenizer | None]:
    """The weights, and the tokenizer that reads --prompt and labels the tokens (None: label by id)."""
    if flags_.hf is not None:
        loaded = weights.load(f"hf:{flags_.hf}")
        use_tokenizer = flags_.ids is None and loaded.tokenizer_meta is not None
    else:
        loaded = weights.load(f"workdir:{flags_.workdir}", which=flags_.which)
        use_tokenizer = loaded.tokenizer_meta is not None
    return loaded, loaded.tokenizer(flags_.bpe_file) if use_tokenizer else None


def parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise UserError(f"--ids must be integers separated by commas or spaces, got {text!r}") from None


def attention(flags_: flags.FlagValues) -> str:
    loaded, tokenizer = load(flags_)
    cfg = loaded.model
    if flags_.ids is not None:
        ids = parse_ids(flags_.ids)
    elif tokenizer is None:
        raise UserError(f"no tokenizer is known for this {cfg.vocab_size}-token vocabulary: pass token ids with --ids")
    else:
        ids = tokenizer.encode(flags_.prompt)
    if not -cfg.n_layer <= flags_.layer < cfg.n_layer:
        raise UserError(f"--layer {flags_.layer} does not exist: the model has layers 0..{cfg.n_layer - 1}")
    layer = flags_.layer % cfg.n_layer
    maps = attention_maps(loaded.params, cfg, ids)
    labels = [str(i) for i in ids] if tokenizer is None else token_labels(tokenizer, ids)
    out = plot_attention(maps[layer], labels, flags_.out,
                         title=f"{loaded.description}: layer {layer} attention, {len(ids)} tokens")
    return f"wrote {out} ({cfg.n_head} heads of layer {layer}, {len(ids)} tokens)"


def curves(flags_: flags.FlagValues) -> str:
    records = read_metrics(flags_.workdir)
    out = plot_training_curves(records, flags_.out, title=flags_.title or Path(flags_.workdir).resolve().name)
    return f"wrote {out} ({len(records)} records)"


def run(flags_: flags.FlagValues, args: list[str]) -> None:
    if not args or args[0] not in SUBCOMMANDS:
        raise UserError("give a sub-command first: `jaxgpt plots curves ...` or `jaxgpt plots attention ...` "
                        "(see --help)")
    no_arguments(args[1:])
    print(curves(flags_) if args[0] == "curves" else attention(flags_))


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(__doc__, define, run, argv)


if __name__ == "__main__":
    sys.exit(main())
