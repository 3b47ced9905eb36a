"""Sample text from a jaxgpt model: python sample.py --workdir DIR [--prompt TEXT | --prompt_file PATH] ...

The model, its config and its tokenizer come from the work directory's latest (or `--which best`) checkpoint.
`--preset NAME` instead samples from a randomly initialized preset with the GPT-2 (r50k) vocabulary, which
exercises the whole pipeline without training (seed 000's demo; the text is nonsense):

    python sample.py --preset seed000 --prompt "A long time ago" --max_new_tokens 10 --temperature 0 --num_samples 2

One sample is printed as it is generated; several are printed one after another, separated by a line of
dashes. A sample ends after --max_new_tokens tokens or at the tokenizer's end-of-text token, if it has one.

Prompts: the text is encoded with the model's tokenizer. An empty prompt (the default) starts from the
end-of-text token when the tokenizer has one (GPT-2 BPE: "a new document"); a character vocabulary has no
such token, so it needs a prompt of at least one character, and characters outside the vocabulary are an
error. Mistakes print one line, `error: ...`, and exit with status 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NoReturn

from jaxgpt.errors import UserError

SEPARATOR = "-" * 40


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad command line is a UserError (one line, exit 2) instead of usage + message."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message} (see python sample.py --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--workdir", help="training work directory whose checkpoint to sample from")
    source.add_argument("--init_from", help="hf:PATH: sample from a Hugging Face GPT-2 directory (save_pretrained "
                                             "layout) with the GPT-2 tokenizer")
    source.add_argument("--preset", help="sample from a randomly initialized preset with the GPT-2 vocabulary "
                                         "(e.g. seed000, gpt2): a pipeline check, no checkpoint needed")
    p.add_argument("--which", choices=("latest", "best"), default="latest", help="which checkpoint of --workdir")
    text = p.add_mutually_exclusive_group()
    text.add_argument("--prompt", default="", help="text to continue (default: empty, see above)")
    text.add_argument("--prompt_file", help="read the prompt from this UTF-8 file")
    p.add_argument("--num_samples", "--batch_size", type=int, default=1, help="samples generated as one batch")
    p.add_argument("--max_new_tokens", type=int, default=500, help="tokens to generate per sample")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy; <1 sharper, >1 flatter")
    p.add_argument("--top_k", type=int, default=None, help="sample only among the k most likely tokens")
    p.add_argument("--top_p", type=float, default=None, help="sample only among the most likely tokens whose "
                                                             "probabilities sum to p (nucleus sampling)")
    p.add_argument("--seed", type=int, default=0, help="random seed (sampling; also the init of --preset)")
    p.add_argument("--window_shift", type=int, default=None,
                   help="beyond block_size tokens of context, the window jumps by this many tokens "
                        "(1 = always the last block_size tokens, exact but slow; default block_size // 2)")
    p.add_argument("--stream_chunk", type=int, default=16,
                   help="a single sample is printed every this many tokens (each chunk is one call of the loop)")
    p.add_argument("--bpe_file", default=None, help="local GPT-2 ranks file (gpt2.tiktoken) for BPE models")
    return p


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt_file is None:
        return args.prompt
    try:
        return Path(args.prompt_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read --prompt_file {args.prompt_file}: {e}") from e


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """The prompt's token ids, with the empty-prompt rule: start from end-of-text, or refuse."""
    ids = tokenizer.encode(text)  # a char tokenizer raises UserError naming unknown characters
    if ids:
        return ids
    if tokenizer.eot_token is None:
        raise UserError("the prompt is empty and this character vocabulary has no start token: "
                        "give --prompt with at least one character")
    return [tokenizer.eot_token]


def load_model(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(params, model config, tokenizer) from a checkpoint, or a random init of a GPT-2-vocabulary preset."""
    import jax

    from jaxgpt.tokenizer import GPT2_VOCAB_SIZE, load_bpe, tokenizer_from_meta

    if args.workdir is not None:
        from jaxgpt.checkpoint import load_for_inference

        logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's notes about read-only access are not news
        params, cfg, meta = load_for_inference(args.workdir, args.which)
        return params, cfg, tokenizer_from_meta(meta["tokenizer"], args.bpe_file)

    if args.init_from is not None:
        kind, _, path = args.init_from.partition(":")
        if kind != "hf" or not path:
            raise UserError(f"--init_from {args.init_from!r} is not understood: use hf:PATH (for a jaxgpt run, "
                            "use --workdir)")
        from jaxgpt.hf import load_hf_gpt2

        params, cfg = load_hf_gpt2(path)
        if cfg.vocab_size != GPT2_VOCAB_SIZE:
            raise UserError(f"{path} has a {cfg.vocab_size}-token vocabulary, not GPT-2's {GPT2_VOCAB_SIZE}: "
                            "jaxgpt has no tokenizer for it")
        return params, cfg, load_bpe("gpt2", args.bpe_file)

    from jaxgpt.model import init_params
    from jaxgpt.presets import get_preset

    cfg = get_preset(args.preset)
    if cfg.vocab_size != GPT2_VOCAB_SIZE:
        raise UserError(f"--preset {args.preset} has a {cfg.vocab_size}-token vocabulary and no tokenizer for it: "
                        f"use a preset with the GPT-2 vocabulary ({GPT2_VOCAB_SIZE}), e.g. seed000 or gpt2")
    tokenizer = load_bpe("gpt2", args.bpe_file)
    params = init_params(cfg, jax.random.key(args.seed))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(f"note: {args.preset} is randomly initialized ({n_params / 1e6:.1f}M parameters): expect nonsense",
          file=sys.stderr)
    return params, cfg, tokenizer


class StreamDecoder:
    """Turns token ids arriving in chunks into text that can be printed at once.

    A BPE token can end in the middle of a UTF-8 character, which decodes to U+FFFD until the rest
    arrives, so trailing replacement characters are held back until the next chunk (or the end).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.ids, self.shown = tokenizer, [], 0

    def push(self, ids: Iterable[int], final: bool = False) -> str:
        self.ids.extend(int(i) for i in ids)
        text = self.tokenizer.decode(self.ids)
        stable = text if final else text.rstrip("\ufffd")
        new, self.shown = stable[self.shown:], max(self.shown, len(stable))
        return new


def until_eot(ids: Iterable[int], eot: int | None) -> list[int]:
    ids = [int(i) for i in ids]
    return ids[: ids.index(eot)] if eot is not None and eot in ids else ids


def run(args: argparse.Namespace) -> None:
    from jaxgpt import sampling

    sampling.validate_options(args.max_new_tokens, args.temperature, args.top_k, args.top_p)
    if args.num_samples < 1:
        raise UserError(f"--num_samples={args.num_samples} must be at least 1")
    if args.stream_chunk < 1:
        raise UserError(f"--stream_chunk={args.stream_chunk} must be at least 1")
    text = read_prompt(args)
    params, cfg, tokenizer = load_model(args)
    prompt = encode_prompt(tokenizer, text)
    eot = tokenizer.eot_token
    options = dict(max_new_tokens=args.max_new_tokens, key=args.seed, num_samples=args.num_samples,
                   temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, eot_token=eot,
                   window_shift=args.window_shift)
    if args.num_samples == 1:
        out = StreamDecoder(tokenizer)
        print(text, end="", flush=True)
        for chunk_BN in sampling.stream(params, cfg, prompt, chunk_size=args.stream_chunk, **options):
            print(out.push(until_eot(chunk_BN[0], eot)), end="", flush=True)
        print(out.push([], final=True))
        return
    tokens_BN = sampling.generate(params, cfg, prompt, **options)
    for i, row in enumerate(tokens_BN):
        if i:
            print(SEPARATOR)
        print(text + tokenizer.decode(until_eot(row, eot)), flush=True)


def main(argv: list[str] | None = None) -> int:
    from jaxgpt.cli import exit_code

    try:
        return exit_code(lambda: run(build_parser().parse_args(argv)))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    from jaxgpt.cli import use_huge_pages

    use_huge_pages()
    sys.exit(main())
