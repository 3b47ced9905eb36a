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


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}: settings go in --config.key=value")
    if _CONFIG.value is None:
        raise app.UsageError("--config is required, e.g. --config configs/stdlib_char.py")
    logging.set_verbosity(logging.WARNING)  # orbax reports every file it renames at INFO
    from jaxgpt.trainer import train

    try:
        train(_CONFIG.value)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
