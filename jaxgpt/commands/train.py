"""Train (or resume) a model: jaxgpt train --config configs/NAME.py [--config.key=value ...]

The config's `task` says what is trained on the one loop (a language model's run ends with a sample of what it
writes). Keys and types are defined in jaxgpt/train/config.py; docs/training.md lists the shipped configs.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from absl import flags

from jaxgpt.commands import define_config, no_arguments, require_config, run_command, use_huge_pages

EXAMPLE = "configs/stdlib_char.py"


def print_sample(cfg: Any, result: dict) -> None:
    """A taste of the trained language model: config.sample's prompt continued with the KV-cache sampler."""
    import jax

    from jaxgpt.data.tokenizer import tokenizer_from_meta
    from jaxgpt.generate.sampling import stream
    from jaxgpt.generate.text_stream import print_stream

    s = cfg.sample
    if cfg.task != "lm" or s.max_new_tokens <= 0 or not result["steps"] or jax.process_index() != 0:
        return  # nothing trained (a finished run resumed): nothing new to show
    tokenizer = tokenizer_from_meta(result["tokenizer_meta"], cfg.data.bpe_file or None)
    params = result["state"]["params"]
    if all(p.is_fully_addressable and p.sharding.is_fully_replicated for p in jax.tree.leaves(params)):
        params = jax.device_put(params, jax.local_devices()[0])  # data-parallel copies: decode on one device
    prompt = tokenizer.encode(s.prompt) or [tokenizer.eot_token or 0]
    print(f"--- sample (temperature {s.temperature}) ---")
    chunks = stream(params, result["model_cfg"], prompt, max_new_tokens=s.max_new_tokens, key=cfg.seed,
                    temperature=s.temperature, top_k=s.top_k or None, top_p=s.top_p, eot_token=tokenizer.eot_token,
                    vocab_limit=tokenizer.vocab_size)
    print_stream(chunks, tokenizer, s.prompt, stops=(), prompt=prompt)  # as the sample command prints
    print("---")


def define(flags_: flags.FlagValues, argv: Sequence[str]) -> None:
    define_config(flags_, argv, EXAMPLE)


def run(flags_: flags.FlagValues, args: list[str]) -> None:
    from jaxgpt.tasks import build
    from jaxgpt.train.config import from_config_dict
    from jaxgpt.train.loop import train

    no_arguments(args)
    cfg = from_config_dict(require_config(flags_, EXAMPLE))
    print_sample(cfg, train(cfg, build))


def usage() -> str:
    """This docstring and the tasks (`jaxgpt.train.task.TASKS`), so that --help names every task there is."""
    from jaxgpt.train.task import TASKS

    listing = "\n".join(f"  {name:<9}{what} ({guide})" for name, (what, guide, _) in TASKS.items())
    return f"{__doc__.strip()}\n\ntasks (--config.task=NAME):\n{listing}"


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(usage(), define, run, argv)


if __name__ == "__main__":
    use_huge_pages()
    sys.exit(main())
