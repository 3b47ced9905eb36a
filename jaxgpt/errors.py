"""The one exception type for mistakes a user can fix, and optional packages that raise it when missing.

Command-line entry points catch `UserError` and print its message as a single line
(`error: ...`) with a non-zero exit and no traceback; anything else is a bug and keeps
its traceback.
"""

import importlib
from types import ModuleType


class UserError(Exception):
    """A bad config, flag, file or prompt: the message names the problem and the fix."""


class StorageError(UserError):
    """A bucket that cannot be reached or used. The storage clients' background threads may still be retrying
    it, so a command that ends with this error exits without waiting for them (`commands.run_command`)."""


class InterruptError(UserError):
    """The run stopped on a signal after saving its state; `status` is the exit status (128 + signal)."""

    def __init__(self, message: str, status: int = 130) -> None:
        super().__init__(message)
        self.status = status


def one_line(message: object, limit: int | None = None) -> str:
    """`str(message)` (an exception, a prompt) on one line, cut at a word boundary past `limit` characters: library
    errors can run to paragraphs, and a one-line error quotes them."""
    text = " ".join(str(message).split())
    return text if limit is None or len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."


def optional_import(module: str, needed_for: str, package: str | None = None, otherwise: str = "") -> ModuleType:
    """`module`, imported; when it is missing, a UserError saying what needs it, how to install it and,
    when there is one, the way to do without it (`otherwise`)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        package = package or module.split(".")[0]
        raise UserError(f"{needed_for} needs {package}, which is not installed: pip install {package}"
                        + (f"; or {otherwise}" if otherwise else "")) from None
