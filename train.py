"""Train a GPT: python train.py --config configs/NAME.py [--config.key=value ...].

A thin command line over `jaxgpt.trainer.train`; see README.md for the configs and their keys.
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from jaxgpt.errors import UserError

_CONFIG = config_flags.DEFINE_config_file("config", None, "training config file (configs/*.py)", lock_config=True)


def one_line(error: BaseException) -> str:
    return " ".join(str(error).replace("\\n", " ").replace("'", "").split())


def parse_flags(argv: list[str]) -> list[str]:
    """absl's parser, with config mistakes (unknown keys, wrong types, missing files) as one-line errors."""
    try:
        return flags.FLAGS(argv)
    except Exception as e:  # flags.Error, or the KeyError/AttributeError/TypeError of a bad override
        print(f"error: bad command line: {one_line(e)} (keys and types are defined in jaxgpt/train_config.py)",
              file=sys.stderr)
        sys.exit(2)


def print_sample(c, result: dict) -> None:
    """A taste of the trained model: config.sample's prompt continued with the KV-cache sampler."""
    import jax

    from jaxgpt.sampling import stream
    from jaxgpt.tokenizer import tokenizer_from_meta

    if c.sample.max_new_tokens <= 0 or jax.process_index() != 0:
        return
    tokenizer = tokenizer_from_meta(result["tokenizer_meta"], c.data.bpe_file or None)
    prompt = tokenizer.encode(c.sample.prompt) or [tokenizer.eot_token or 0]
    print(f"--- sample (temperature {c.sample.temperature}) ---\n{c.sample.prompt}", end="", flush=True)
    for chunk in stream(result["state"]["params"], result["model_cfg"], prompt, max_new_tokens=c.sample.max_new_tokens,
                        key=c.seed, temperature=c.sample.temperature, top_k=c.sample.top_k or None,
                        top_p=c.sample.top_p, eot_token=tokenizer.eot_token):
        print(tokenizer.decode(chunk[0].tolist()), end="", flush=True)
    print("\n---")


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}: settings go in --config.key=value")
    if _CONFIG.value is None:
        raise app.UsageError("--config is required, e.g. --config configs/stdlib_char.py")
    logging.set_verbosity(logging.WARNING)  # orbax reports every file it renames at INFO
    from jaxgpt.trainer import train

    try:
        print_sample(_CONFIG.value, train(_CONFIG.value))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
