"""Mistakes a user can fix, told apart from bugs by their type.

The command line prints an exception of these types as one line, `error: MESSAGE`, and exits with status 2; any
other exception that ends a command is a bug in shipyard and is shown with its traceback, exit status 1 (a training
run also writes it to RUN/error.txt and marks the run failed: `shipyard.rl.rundir.RunDir.fail`). So a user mistake
must raise one of these — a subclass of `UserError` — and never a bare ValueError or FileNotFoundError, which would
read as a bug; a bug deep in a run that happens to be a ValueError is not dressed up as a mistake.

The module imports nothing, so any layer can raise these, and the command line can name them without importing the
layers. The specific errors of a layer subclass `UserError` where they are defined (`ConfigError`, `TaskFormatError`,
`ModelNotFound`, `RunDirError`, …), keeping the built-in base they had (ValueError, RuntimeError, …).
"""


class UserError(Exception):
    """A mistake the user can fix: its message says what is wrong and what to do, and is shown without a traceback."""


class UsageError(UserError, ValueError):
    """An option, a setting or a combination of them that is not allowed."""


class InputNotFound(UserError, FileNotFoundError):
    """A file or directory the user named does not exist, or is not the kind asked for."""


class FileFormatError(UserError, ValueError):
    """A file the user gave is not in the format it should be: the message names the file, where, and what is wrong."""
