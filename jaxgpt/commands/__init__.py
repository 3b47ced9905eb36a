"""The command layer: the only place that parses command lines.

Every command is a module here with a docstring (its help), `define(flags_, argv)` (its absl flags, on a
fresh `FlagValues`, so commands can run one after another in one process), and `run(flags_, args)`.
`main(argv)` of each module calls `run_command`, which turns bad flags, config overrides and jaxgpt's
`UserError` and file-system faults (`OSError`: a full disk, a read-only directory) into one line on stderr
and exit status 2 (128 + the signal for a run stopped by SIGINT / SIGTERM); anything else is a bug and keeps
its traceback.

    jaxgpt COMMAND [--flag=value ...]          (console script)
    python -m jaxgpt COMMAND [--flag=value ...]
    python train.py / sample.py ...            (from a checkout: the same commands)
"""

from __future__ import annotations

import contextlib
import importlib
import os
import platform
import sys
from collections.abc import Callable, Mapping, Sequence

from absl import flags
from ml_collections import ConfigDict, config_flags

from jaxgpt import storage
from jaxgpt.errors import InterruptError, StorageError, UserError, one_line

# Each command: its one line, and the guide (in the source tree) that covers it. `jaxgpt --help` lists both.
COMMANDS = {
    "train": ("train or resume a run: --config configs/NAME.py [--config.KEY=VALUE ...]", "docs/training.md"),
    "sample": ("generate text (or chat) from a run, Hugging Face weights, a GGUF file or a preset", "docs/sampling.md"),
    "data": ("prepare a dataset from text files, a corpus or a built-in dataset", "docs/data.md"),
    "serve": ("an OpenAI-compatible completions and chat server (continuous batching)", "docs/serving.md"),
    "eval": ("loss, perplexity, bits per token/character; HellaSwag, LAMBADA", "docs/evaluation.md"),
    "harness": ("lm-evaluation-harness with --model jaxgpt", "docs/evaluation.md"),
    "hf": ("Hugging Face directories (GPT-2, NanoChat, Llama, Mistral, Qwen, Gemma 3) in and out: `hf inspect`, "
           "`hf export`", "docs/huggingface.md"),
    "bpe": ("the GPT-2 BPE ranks file for offline machines: `bpe fetch`, `bpe verify`", "docs/data.md"),
    "summary": ("parameter table of a preset, config or Hugging Face directory", "docs/models.md"),
    "plots": ("figures: `plots curves`, `plots attention`, `plots positions`", "docs/models.md"),
    "aot": ("compile the sharded train step for a TPU slice or GPUs here: memory, FLOPs, roofline",
            "docs/scaling.md"),
}
# Commands whose processes run long XLA programs: they restart once with huge-page malloc (see below).
LONG_RUNNING = ("train", "sample")
HUGE_PAGES = "glibc.malloc.hugetlb=1"

Define = Callable[[flags.FlagValues, Sequence[str]], None]
Action = Callable[[flags.FlagValues, list[str]], object]


def use_huge_pages() -> None:
    """Restart this process, once, with glibc's malloc asking the kernel for transparent huge pages.

    XLA:CPU allocates each execution's temporaries as one block that glibc maps fresh from the kernel every
    time: with 4 KiB pages, a page fault for every 4 KiB of it, each step, which costs a small model a large
    share of its step on a CPU (docs/training.md gives the measurement). The `glibc.malloc.hugetlb=1`
    tunable (glibc >= 2.35; older ones ignore it) marks such blocks for 2 MiB pages on kernels whose
    transparent-huge-page mode is `madvise`, the common default. glibc reads tunables only at startup,
    hence the restart, first thing in a long-running command. JAXGPT_HUGE_PAGES=0 opts out.
    """
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if (sys.platform != "linux" or "glibc.malloc.hugetlb" in tunables or os.environ.get("JAXGPT_HUGE_PAGES") == "0"
            or platform.libc_ver()[0] != "glibc"):
        return
    env = {**os.environ, "GLIBC_TUNABLES": ":".join(filter(None, (tunables, HUGE_PAGES)))}
    with contextlib.suppress(OSError):  # if the restart fails, carry on with small pages
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def error_line(error: BaseException) -> str:
    """How a command prints an error: `errors.one_line` of its message without the quotes and escaped newlines
    that KeyError's and absl's messages carry."""
    return one_line(str(error).replace("\\n", " ").replace("'", ""))


def define_config(flags_: flags.FlagValues, argv: Sequence[str], example: str) -> None:
    """--config FILE with `--config.key=value` overrides (ml_collections), locked so unknown keys fail."""
    # ml_collections loads the file as module "config_config" into an existing module of that name, so a file
    # loaded earlier in this process would lend its names (its get_config) to one that lacks them.
    sys.modules.pop("config_config", None)
    config_flags.DEFINE_config_file("config", None, f"config file, e.g. {example}", flag_values=flags_,
                                    lock_config=True, sys_argv=list(argv))


def require_config(flags_: flags.FlagValues, example: str) -> ConfigDict:
    """The parsed --config; a missing, unloadable or wrongly typed config file is a UserError."""
    if not flags_["config"].present:
        raise UserError(f"--config is required, e.g. --config {example}")
    path, config = config_flags.get_config_filename(flags_["config"]), flags_.config
    if config is None:
        raise UserError(f"{path}: get_config() returned None: end it with `return c`, the ConfigDict it built "
                        f"(see {example})")
    if not isinstance(config, ConfigDict | list | tuple | dict | str | int | float):
        try:
            config.keys()  # ml_collections defers a failed load: any use of the placeholder raises
        except Exception as e:
            raise UserError(f"cannot load the --config file {path}: {error_line(e)}") from None
    if not isinstance(config, ConfigDict):
        raise UserError(f"{path}: get_config() returned a {type(config).__name__}, not an ml_collections "
                        f"ConfigDict: start it from jaxgpt.train.config.base_config() (see {example})")
    return config


def load_config_file(path: str, example: str) -> ConfigDict:
    """A config file loaded exactly as `--config FILE` loads it, for commands that take one without overrides."""
    argv = ["jaxgpt", f"--config={path}"]
    flags_ = flags.FlagValues()
    define_config(flags_, argv, example)
    try:
        flags_(argv)
    except Exception as e:  # a syntax error, or no get_config(): ml_collections raises at parse time
        raise UserError(f"cannot load the --config file {path}: {parse_error(e)}") from None
    return require_config(flags_, example)


def parse_error(e: Exception) -> str:
    """One line for a command line that did not parse: a bad flag, config override or config file."""
    if "get_config" in str(e):
        return "the --config file defines no get_config()"
    if isinstance(e, KeyError | AttributeError) and e.args:
        text = str(e.args[0]).replace("\\n", " ").translate(str.maketrans("", "", "\\'\""))
        return "unknown config key " + " ".join(text.split())
    return error_line(e)


def check_locations(flags_: flags.FlagValues, locations: Mapping[str, str]) -> None:
    """Refuse each value of a flag in `locations` (flag name -> `storage.check` kind) that names a place the flag
    cannot use, before the command reads or writes anything. Flags of sub-commands not defined this time, and
    unset ones, are skipped."""
    for name, kind in locations.items():
        value = flags_[name].value if name in flags_ else None
        for text in value if isinstance(value, list) else [value]:
            if text:
                storage.check(text, f"--{name}", kind)


def run_command(doc: str, define: Define, action: Action, argv: Sequence[str] | None = None,
                locations: Mapping[str, str] | None = None) -> int:
    """Parse `argv` (default sys.argv) with the command's flags and run it; returns the exit status.

    `locations` names the command's flags that take a file or directory, with what each takes (`storage.check`).
    """
    argv = list(sys.argv if argv is None else argv)
    flags_ = flags.FlagValues()
    define(flags_, argv)
    if any(a in ("-h", "--help", "-help", "--helpfull") for a in argv[1:]):
        print(doc.strip() + "\n\nflags:\n" + flags_.get_help(include_special_flags=False))
        return 0
    from absl import logging

    # orbax reports every file it writes, and logs (with tracebacks, from each of its threads) the failures that
    # it also raises; ml_collections warns of a config that returned None, which require_config reports: what
    # is raised is reported here, once, as one line.
    logging.set_verbosity(logging.FATAL)
    try:
        args = flags_(argv)[1:]
    except Exception as e:  # flags.Error, or the KeyError/AttributeError/TypeError of a bad config override
        print(f"error: bad command line: {parse_error(e)} (see {os.path.basename(argv[0])} --help)", file=sys.stderr)
        return 2
    try:
        check_locations(flags_, locations or {})
        action(flags_, args)
    except InterruptError as e:  # a run that saved its state on SIGINT / SIGTERM
        print(f"error: {error_line(e)}", file=sys.stderr)
        return e.status
    except StorageError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(2)  # not waiting for orbax's and the clients' threads, which may retry the store for minutes
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except OSError as e:  # the environment, not the code: a full disk, a read-only or vanished directory
        print(f"error: {os_error_line(e)}", file=sys.stderr)
        return 2
    return 0


def os_error_line(e: OSError) -> str:
    """One line for a file-system fault: what failed, on which path, and what to do."""
    where = f" ({e.filename})" if e.filename else ""
    if e.errno in storage.DISK_FULL:
        return f"{e.strerror}{where}: free space there (or raise the file-size limit), then run the command again"
    return f"{e.strerror or error_line(e)}{where}"


def no_arguments(args: list[str]) -> None:
    if args:
        raise UserError(f"unexpected arguments {args}: every setting is a --flag (see --help)")


def dispatch(argv: Sequence[str] | None = None) -> int:
    """`jaxgpt COMMAND ...` / `python -m jaxgpt COMMAND ...`: run one command module's `main`."""
    argv = list(sys.argv if argv is None else argv)
    if len(argv) < 2 or argv[1] not in COMMANDS:
        listing = "\n".join(f"  {name:<8} {guide:<20} {what}" for name, (what, guide) in COMMANDS.items())
        print(f"usage: jaxgpt COMMAND [--flag=value ...]   (jaxgpt COMMAND --help for its flags)\n\n"
              f"  command  guide (in jaxgpt's source tree)\n{listing}",
              file=sys.stderr if len(argv) > 1 and argv[1] not in ("-h", "--help") else sys.stdout)
        return 0 if len(argv) > 1 and argv[1] in ("-h", "--help") else 2
    return importlib.import_module(f"jaxgpt.commands.{argv[1]}").main([f"jaxgpt {argv[1]}", *argv[2:]])


def main() -> None:
    """The `jaxgpt` console script and `python -m jaxgpt`: a fresh process, so long runs may restart it first."""
    if len(sys.argv) > 1 and sys.argv[1] in LONG_RUNNING:
        use_huge_pages()
    sys.exit(dispatch())
