"""What every jaxgpt command shares: user mistakes end as one line on stderr and exit status 2.

Config-driven commands (`--config FILE [--config.key=value ...]`) use absl's flag parsing and
ml_collections' overrides; this module turns their exceptions, and jaxgpt's UserError, into that line.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from jaxgpt.errors import UserError


def one_line(error: BaseException) -> str:
    return " ".join(str(error).replace("\\n", " ").replace("'", "").split())


def exit_code(action: Callable[[], object]) -> int:
    """0 after `action()`; a UserError becomes `error: ...` on stderr and status 2 (no traceback)."""
    try:
        action()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def flags_parser(hint: str) -> Callable[[list[str]], list[str]]:
    """absl's parser for `app.run`, with bad flags and config overrides (unknown keys, wrong types,
    missing files) reported as one line ending in `hint`, and exit status 2."""
    from absl import flags

    def parse(argv: list[str]) -> list[str]:
        try:
            return flags.FLAGS(argv)
        except Exception as e:  # flags.Error, or the KeyError/AttributeError/TypeError of a bad override
            print(f"error: bad command line: {one_line(e)} ({hint})", file=sys.stderr)
            sys.exit(2)

    return parse


def run_config_command(run: Callable[[Any], object], *, example: str, keys_in: str) -> None:
    """Define --config, parse the command line and call `run(config)`; user mistakes exit 2 with one line."""
    from absl import app, logging
    from ml_collections import config_flags

    config = config_flags.DEFINE_config_file("config", None, f"config file, e.g. {example}", lock_config=True)

    def main(argv: list[str]) -> int:
        if len(argv) > 1:
            raise app.UsageError(f"unexpected arguments {argv[1:]}: settings go in --config.key=value")
        if config.value is None:
            raise app.UsageError(f"--config is required, e.g. --config {example}")
        logging.set_verbosity(logging.ERROR)  # orbax reports every file it writes, and every read-only open
        return exit_code(lambda: run(config.value))

    app.run(main, flags_parser=flags_parser(f"keys and types are defined in {keys_in}"))
