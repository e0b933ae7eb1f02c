"""Errors in what the user asked for. The CLI prints their message as one line and exits non-zero (no traceback)."""

EXIT_USER_ERROR = 2  # the exit status of a mistake in what was asked for (as argparse's usage errors)


class UserError(Exception):
    """Bad input: the message says what is wrong and what to do about it."""


class ConfigError(UserError, ValueError):
    """A flag value or combination of flags that cannot be used."""


class TrainingDiverged(UserError, RuntimeError):
    """The loss became NaN or infinite."""


class MissingPackage(UserError, ImportError):
    """An optional package that what was asked for needs is not installed: the message names the extra to install."""


class UsageError(UserError):
    """A command line argparse cannot parse; ``prog`` is the (sub)command it belongs to."""

    def __init__(self, message: str, prog: str):
        super().__init__(message)
        self.prog = prog
