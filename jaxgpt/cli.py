"""The shared shape of config-driven commands: `--config FILE [--config.key=value ...]`.

Flag parsing is absl's and config overrides are ml_collections'; this module only turns their
exceptions, and jaxgpt's UserError, into one line on stderr and exit status 2.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from jaxgpt.errors import UserError


def one_line(error: BaseException) -> str:
    return " ".join(str(error).replace("\\n", " ").replace("'", "").split())


def run_config_command(run: Callable[[Any], object], *, example: str, keys_in: str) -> None:
    """Define --config, parse the command line and call `run(config)`; user mistakes exit 2 with one line."""
    from absl import app, flags, logging
    from ml_collections import config_flags

    config = config_flags.DEFINE_config_file("config", None, f"config file, e.g. {example}", lock_config=True)

    def parse(argv: list[str]) -> list[str]:
        try:
            return flags.FLAGS(argv)
        except Exception as e:  # flags.Error, or the KeyError/AttributeError/TypeError of a bad override
            print(f"error: bad command line: {one_line(e)} (keys and types are defined in {keys_in})",
                  file=sys.stderr)
            sys.exit(2)

    def main(argv: list[str]) -> int:
        if len(argv) > 1:
            raise app.UsageError(f"unexpected arguments {argv[1:]}: settings go in --config.key=value")
        if config.value is None:
            raise app.UsageError(f"--config is required, e.g. --config {example}")
        logging.set_verbosity(logging.ERROR)  # orbax reports every file it writes, and every read-only open
        try:
            run(config.value)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0

    app.run(main, flags_parser=parse)
