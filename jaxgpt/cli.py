"""What every jaxgpt command shares: user mistakes end as one line on stderr and exit status 2.

Config-driven commands (`--config FILE [--config.key=value ...]`) use absl's flag parsing and
ml_collections' overrides; this module turns their exceptions, and jaxgpt's UserError, into that line.
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
from collections.abc import Callable
from typing import Any

from jaxgpt.errors import UserError

HUGE_PAGES = "glibc.malloc.hugetlb=1"


def use_huge_pages() -> None:
    """Restart this process, once, with glibc's malloc asking the kernel for transparent huge pages.

    XLA:CPU allocates each execution's temporaries as one block (736 MB per training step of the quick
    start) that glibc maps fresh from the kernel every time: with 4 KiB pages that is about 190,000 page
    faults per step, a third of the quick start's step time on 2 cores. The `glibc.malloc.hugetlb=1`
    tunable (glibc >= 2.35; older ones ignore it) marks such blocks for 2 MiB pages on kernels whose
    transparent-huge-page mode is `madvise`, the common default. glibc reads tunables only at startup,
    hence the restart; call this first thing in a command's `__main__`. JAXGPT_HUGE_PAGES=0 opts out.
    """
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if (sys.platform != "linux" or "glibc.malloc.hugetlb" in tunables or os.environ.get("JAXGPT_HUGE_PAGES") == "0"
            or platform.libc_ver()[0] != "glibc"):
        return
    env = {**os.environ, "GLIBC_TUNABLES": ":".join(filter(None, (tunables, HUGE_PAGES)))}
    with contextlib.suppress(OSError):  # if the restart fails, carry on with small pages
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


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
