"""The one exception type for mistakes a user can fix.

Command-line entry points catch `UserError` and print its message as a single line
(`error: ...`) with a non-zero exit and no traceback; anything else is a bug and keeps
its traceback.
"""


class UserError(Exception):
    """A bad config, flag, file or prompt: the message names the problem and the fix."""


class InterruptError(UserError):
    """The run stopped on a signal after saving its state; `status` is the exit status (128 + signal)."""

    def __init__(self, message: str, status: int = 130) -> None:
        super().__init__(message)
        self.status = status
