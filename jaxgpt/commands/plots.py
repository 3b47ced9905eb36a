"""Figures: training curves, the attention heatmaps of one layer for a prompt, sinusoidal position codes.

    jaxgpt plots curves --workdir DIR --out curves.png [--title T]
    jaxgpt plots attention --workdir DIR --prompt "Hello there" --layer 0 --out attn.png [--which best]
    jaxgpt plots attention --hf PATH --prompt "Hello there" --layer 5 --out attn.png [--bpe_file gpt2.tiktoken]
    jaxgpt plots attention --hf PATH --ids 464,2068,7586 --layer -1 --out attn.png
    jaxgpt plots attention --preset annotated-transformer-decoder --prompt "A long time ago" --layer 0 \
        --out attn.png   (untrained)
    jaxgpt plots attention --preset keras-transformer --ids 5,6,7,8 --target_ids 1,5,6 --layer 0 --out attn.png
    jaxgpt plots positions --out positions.png [--length 100 --width 128 --layout sinusoidal --frequencies 4,16]

The sub-command comes first; `jaxgpt plots SUBCOMMAND --help` lists its flags. A run's tokenizer labels
the tokens; a Hugging Face directory or a preset with GPT-2's vocabulary is read with GPT-2's BPE, and --ids
are shown as numbers when there is no tokenizer. An encoder-decoder (a seq2seq run, or a preset such as
keras-transformer) reads --prompt / --ids as the source and --target / --target_ids as the decoder's input
(default: the source's tokens), and draws its encoder self-attention, decoder self-attention and
cross-attention, one row each. `positions` draws the position-code matrix of seed 000's interleaved and
seed 002's concatenated layouts, and the sine and cosine of a few frequencies over position.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from absl import flags

from jaxgpt import storage
from jaxgpt.commands import no_arguments, run_command
from jaxgpt.data.tokenizer import GPT2_TOKENIZER_META, GPT2_VOCAB_SIZE, Tokenizer
from jaxgpt.errors import UserError
from jaxgpt.io import weights
from jaxgpt.model.config import Seq2SeqConfig
from jaxgpt.model.presets import PRESETS, SEQ2SEQ_PRESETS
from jaxgpt.tools import plots

SUBCOMMANDS = ("curves", "attention", "positions")
# The flags that name a file or directory (of whichever sub-command defines them), and what each takes.
LOCATIONS = {"out": storage.LOCAL, "workdir": storage.ANYWHERE, "hf": storage.ANYWHERE, "bpe_file": storage.LOCAL}


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
    if sub == "positions":
        flags.DEFINE_integer("length", 100, "positions (rows of the table)", flag_values=flags_)
        flags.DEFINE_integer("width", 128, "dimensions (n_embd; even)", flag_values=flags_)
        flags.DEFINE_enum("layout", "both", ("both", *plots.LAYOUTS), "sinusoidal (seed 000: sin/cos interleaved), "
                          "sinusoidal_concat (seed 002: [sin..., cos...]) or both", flag_values=flags_)
        flags.DEFINE_list("frequencies", [], "frequency indices i whose sine and cosine are drawn (default: "
                          "width/32 and width/8)", flag_values=flags_)
        flags.DEFINE_string("title", "", "figure title", flag_values=flags_)
        return
    flags.DEFINE_string("workdir", None, "a training work directory (its checkpoint)", flag_values=flags_)
    flags.DEFINE_string("hf", None, "a Hugging Face checkpoint directory (any family `jaxgpt hf` reads)",
                        flag_values=flags_)
    flags.DEFINE_string("preset", None, f"an untrained preset: one of {', '.join([*PRESETS, *SEQ2SEQ_PRESETS])}",
                        flag_values=flags_)
    flags.mark_flags_as_mutual_exclusive(["workdir", "hf", "preset"], required=True, flag_values=flags_)
    flags.DEFINE_integer("seed", 0, "initialization seed of --preset", flag_values=flags_)
    flags.DEFINE_string("prompt", None, "text to tokenize (an encoder-decoder's source)", flag_values=flags_)
    flags.DEFINE_string("ids", None, "token ids instead of text, e.g. '464,2068,7586'", flag_values=flags_)
    flags.mark_flags_as_mutual_exclusive(["prompt", "ids"], required=True, flag_values=flags_)
    flags.DEFINE_string("target", None, "an encoder-decoder's decoder input as text (default: the source)",
                        flag_values=flags_)
    flags.DEFINE_string("target_ids", None, "the decoder input as token ids", flag_values=flags_)
    flags.mark_flags_as_mutual_exclusive(["target", "target_ids"], flag_values=flags_)
    flags.DEFINE_integer("layer", None, "layer index (0-based; -1 = last)", flag_values=flags_)
    flags.mark_flag_as_required("layer", flag_values=flags_)
    flags.DEFINE_enum("which", "latest", ("latest", "best"), "checkpoint of --workdir", flag_values=flags_)
    flags.DEFINE_string("bpe_file", None, "GPT-2 BPE ranks file when offline", flag_values=flags_)


def untrained_seq2seq(name: str, seed: int) -> weights.Weights:
    """A randomly initialized encoder-decoder preset, read with GPT-2's BPE when it has GPT-2's vocabulary."""
    import jax

    from jaxgpt.model.encdec import init_params

    cfg = SEQ2SEQ_PRESETS[name]
    meta = dict(GPT2_TOKENIZER_META) if cfg.model.vocab_size == cfg.src_vocab_size == GPT2_VOCAB_SIZE else None
    return weights.Weights(init_params(cfg, jax.random.key(seed)), cfg, meta, {}, f"{name} (random init, seed {seed})")


def load(flags_: flags.FlagValues) -> tuple[weights.Weights, Tokenizer | None]:
    """The weights, and the tokenizer that reads --prompt and labels the tokens (None: label by id)."""
    if flags_.preset is not None and flags_.preset not in PRESETS and flags_.preset not in SEQ2SEQ_PRESETS:
        raise UserError(f"unknown preset {flags_.preset!r}: choose one of {sorted([*PRESETS, *SEQ2SEQ_PRESETS])}")
    if flags_.hf is not None or flags_.preset is not None:
        if flags_.preset in SEQ2SEQ_PRESETS:
            loaded = untrained_seq2seq(flags_.preset, flags_.seed)
        elif flags_.preset is not None:
            loaded = weights.load(f"preset:{flags_.preset}", seed=flags_.seed)
        else:
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


def read_tokens(ids: str | None, text: str | None, tokenizer: Tokenizer | None, vocab_size: int, flag: str
                ) -> list[int]:
    if ids is not None:
        return parse_ids(ids)
    if tokenizer is None:
        raise UserError(f"no tokenizer is known for this {vocab_size}-token vocabulary: pass token ids with {flag}")
    return tokenizer.encode(text)


def attention(flags_: flags.FlagValues) -> str:
    loaded, tokenizer = load(flags_)
    cfg = loaded.model
    seq2seq = isinstance(cfg, Seq2SeqConfig)
    gpt = cfg.model if seq2seq else cfg
    if not seq2seq and (flags_.target is not None or flags_.target_ids is not None):
        raise UserError("--target / --target_ids are an encoder-decoder's decoder input: this model is a GPT")
    ids = read_tokens(flags_.ids, flags_.prompt, tokenizer, gpt.vocab_size, "--ids")
    n_layer = min(gpt.n_layer, cfg.n_encoder_layer) if seq2seq else gpt.n_layer
    if not -n_layer <= flags_.layer < n_layer:
        raise UserError(f"--layer {flags_.layer} does not exist: the model has layers 0..{n_layer - 1}")
    layer = flags_.layer % n_layer
    labels = lambda ids: [str(i) for i in ids] if tokenizer is None else plots.token_labels(tokenizer, ids)
    if seq2seq:
        tgt = ids if flags_.target is None and flags_.target_ids is None else read_tokens(
            flags_.target_ids, flags_.target, tokenizer, gpt.vocab_size, "--target_ids")
        maps = plots.seq2seq_attention_maps(loaded.params, cfg, ids, tgt)
        panels = plots.seq2seq_panels(maps, layer, labels(ids), labels(tgt))
        out = plots.plot_attention_panels(panels, gpt.n_head, flags_.out,
                                          title=f"{loaded.description}: layer {layer} attention, {len(ids)} source "
                                                f"and {len(tgt)} target tokens")
        return (f"wrote {out} (encoder, decoder and cross-attention of layer {layer}, {gpt.n_head} heads each; "
                f"{len(ids)} source, {len(tgt)} target tokens)")
    maps = plots.attention_maps(loaded.params, cfg, ids)
    out = plots.plot_attention(maps[layer], labels(ids), flags_.out,
                               title=f"{loaded.description}: layer {layer} attention, {len(ids)} tokens")
    return f"wrote {out} ({cfg.n_head} heads of layer {layer}, {len(ids)} tokens)"


def positions(flags_: flags.FlagValues) -> str:
    try:
        frequencies = [int(f) for f in flags_.frequencies]
    except ValueError:
        raise UserError(f"--frequencies must be integers, got {','.join(flags_.frequencies)}") from None
    layouts = plots.LAYOUTS if flags_.layout == "both" else (flags_.layout,)
    panels = plots.position_panels(flags_.length, flags_.width, layouts, frequencies)
    out = plots.plot_positions(panels, flags_.out, title=flags_.title)
    return f"wrote {out} ({', '.join(layouts)}: {flags_.length} positions x {flags_.width} dimensions)"


def curves(flags_: flags.FlagValues) -> str:
    records = plots.read_metrics(flags_.workdir)
    out = plots.plot_training_curves(records, flags_.out, title=flags_.title or Path(flags_.workdir).resolve().name)
    return f"wrote {out} ({len(records)} records)"


def run(flags_: flags.FlagValues, args: list[str]) -> None:
    if not args or args[0] not in SUBCOMMANDS:
        raise UserError("give a sub-command first: `jaxgpt plots curves ...`, `jaxgpt plots attention ...` or "
                        "`jaxgpt plots positions ...` (see --help)")
    no_arguments(args[1:])
    print({"curves": curves, "attention": attention, "positions": positions}[args[0]](flags_))


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(__doc__, define, run, argv, LOCATIONS)


if __name__ == "__main__":
    sys.exit(main())
