"""The GPT-2 BPE ranks file (gpt2.tiktoken): fetch it through PyPI, or check the one jaxgpt would use.

    jaxgpt bpe fetch [--dest PATH]     # pip download openai-whisper's sdist, extract, sha256-check, write
    jaxgpt bpe verify [--dest PATH]    # is the file there and exactly the GPT-2 ranks?

The default PATH is $JAXGPT_BPE_FILE if set, else ~/.cache/jaxgpt/gpt2.tiktoken, where jaxgpt looks for the
ranks when no --bpe_file is given; with the file there, GPT-2 BPE works offline.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from absl import flags

from jaxgpt import storage
from jaxgpt.commands import run_command
from jaxgpt.data import bpe_ranks
from jaxgpt.data.tokenizer import BPE_FILE_ENV, configured_bpe_file
from jaxgpt.errors import UserError

SUBCOMMANDS = ("fetch", "verify")
LOCATIONS = {"dest": storage.LOCAL}  # (`storage.check`: a file written and read on this machine)


def define(flags_: flags.FlagValues, argv: Sequence[str]) -> None:
    flags.DEFINE_string("dest", None, "the ranks file (default: $JAXGPT_BPE_FILE, else ~/.cache/jaxgpt/gpt2.tiktoken)",
                        flag_values=flags_)


def run(flags_: flags.FlagValues, args: list[str]) -> None:
    if args not in ([name] for name in SUBCOMMANDS):
        raise UserError("give one sub-command: `jaxgpt bpe fetch` or `jaxgpt bpe verify` (see --help)")
    dest = Path(flags_.dest) if flags_.dest else configured_bpe_file()
    hint = "" if dest == configured_bpe_file() else f"; use it with {BPE_FILE_ENV}={dest}"
    if args[0] == "verify":
        if not bpe_ranks.is_valid(dest):
            raise UserError(f"{dest} is {'not the GPT-2 ranks' if dest.exists() else 'missing'}: run `jaxgpt bpe fetch"
                            f"{'' if flags_.dest is None else ' --dest ' + str(dest)}`")
        print(f"{dest}: the GPT-2 ranks (sha256 ok){hint}")
        return
    path, fetched = bpe_ranks.fetch(dest)
    print(f"{'wrote' if fetched else 'kept'} {path} (sha256 ok){hint}")


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(__doc__, define, run, argv, LOCATIONS)


if __name__ == "__main__":
    sys.exit(main())
