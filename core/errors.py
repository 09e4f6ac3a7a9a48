"""The errors a user can act on, and the exit status of each kind (the same for every CLI).

    2  bad usage or input, found before any work: an unknown flag or config field, a value out of
       its range, a missing or unreadable input, an output path that cannot be written, a config
       that does not fit the workdir's checkpoints
    1  a failure while running: a save that failed, a job that could not start, training that
       diverged, a checkpoint that cannot be restored on this machine

Library code raises `UsageError` / `RunError` (or the built-in `ValueError` / `RuntimeError` /
`OSError` they stand for); `cli.app.run` prints them as one line `<prog>: error: <message>` and
exits with `exit_status(error)`. Any other exception is a bug and keeps its traceback.

The library speaks Python: bad input in one argument is an `ArgumentError` naming the argument as
the caller wrote it (`checkpoint='x': expected ...`); a command line whose flag of that name gave
the value prints it as the flag (`--checkpoint=x: expected ...`, `cli.app.run`).
"""

from __future__ import annotations

import os

USAGE = 2
FAILURE = 1
# Set (to anything) in the environment, every error keeps its traceback.
TRACEBACK_ENV = "ATTENTION_JAX_TRACEBACK"


class UsageError(ValueError):
  """Bad usage or input, found before any work: exit status 2."""


class RunError(RuntimeError):
  """A failure while running: exit status 1."""


class ArgumentError(UsageError):
  """Bad input in the argument `name` of a Python call: `name=value: problem` (the value as
  Python writes it). `as_flag(flag)` is the same as a command line's flag gave it."""

  def __init__(self, name: str, value, problem: str):
    self.name, self.value, self.problem = name, value, problem
    self._text = os.fspath(value) if isinstance(value, os.PathLike) else value  # a path as a str
    super().__init__(f"{name}={self._text!r}: {problem}")

  def __reduce__(self):  # picklable with its three parts (Exception pickles only the message)
    return type(self), (self.name, self.value, self.problem)

  def as_flag(self, flag: str) -> str:
    """'--<flag>=<value>: <problem>', the value as it was typed."""
    return f"--{flag}={self._text}: {self.problem}"


def exit_status(error: BaseException) -> int | None:
  """2 or 1 for the errors above and the built-in ones they stand for; None for anything else
  (a bug: let its traceback show)."""
  if isinstance(error, (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError)):
    return USAGE
  if isinstance(error, (RuntimeError, OSError)):
    return FAILURE
  return None


def message(error: BaseException) -> str:
  """The error's text; an `OSError` without its own words names its file and the system's reason."""
  if (
    isinstance(error, OSError) and not isinstance(error, (UsageError, RunError)) and error.strerror
  ):
    where = f"{error.filename}: " if error.filename else ""
    return f"{where}{error.strerror}"
  return str(error) or type(error).__name__


def first_line(e: Exception) -> str:
  """'<Type>: <first line of the message>' of an exception, at most 200 characters of text."""
  text = str(e).splitlines()[0][:200] if str(e) else ""
  return f"{type(e).__name__}: {text}" if text else type(e).__name__
