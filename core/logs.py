"""Which log lines a person sees: this project's lines (progress, records, warnings that concern
the user) always, and its detail lines (phases, shapes, programs) with `--verbosity=1` (absl's
`-v 1`); libraries' chatter (their INFO and DEBUG lines, such as Orbax's thousands of per-array
restore lines and JAX's compilation-cache lines) and the warnings that describe expected states
(Orbax's missing-metadata warning on restore, its warning at every save without metrics) only with
`--verbosity=2` or higher (`LIBRARY_VERBOSITY`); the ~300 lines of tracebacks Orbax logs for a
failed save before its caller reports it, only with `--verbosity=1` or ATTENTION_JAX_TRACEBACK=1.

Importing or using the library changes no logger: the policy is installed by a call.

    core.logs.command_line_logs()   # cli.app.run, for every command line
    core.logs.quiet_library_logs()  # Python users who want the same quiet (also
                                    # `from inference import quiet_library_logs`)
"""

from __future__ import annotations

import logging
import os
import pathlib

from absl import logging as absl_logging

from core.errors import TRACEBACK_ENV, first_line

PROJECT_ROOT = str(pathlib.Path(__file__).resolve().parents[1])

# Library warnings that are not problems here, hidden below LIBRARY_VERBOSITY.
EXPECTED_WARNINGS = (
  "Unable to initialize backend",  # JAX probing for a TPU or GPU it does not find
  "Metadata file does not exist",  # Orbax restoring a checkpoint written without one
  # Orbax at every save without metrics once best_fn is set (checkpoint.keep_best): only
  # evaluation steps carry a BLEU, so the other saves are expected.
  "did not provide metrics",
)
# Where Orbax logs an error with its traceback and then raises it to the caller, which reports it.
_ORBAX_RERAISED = {
  ("future.py", "run"),  # a commit thread's error, raised again by its future
  ("async_checkpointer.py", "_thread_func"),  # the same, raised again by wait_until_finished
  ("checkpoint_manager.py", "wait_until_finished"),
}


LIBRARY_VERBOSITY = 2  # from this absl verbosity on, libraries' chatter is shown


def _verbose(level: int = 1) -> bool:
  return absl_logging.get_verbosity() >= level


def _expected(record: logging.LogRecord) -> bool:
  return record.levelno == logging.WARNING and any(
    text in record.getMessage() for text in EXPECTED_WARNINGS
  )


class _ExpectedWarnings(logging.Filter):
  """Drops the EXPECTED_WARNINGS below LIBRARY_VERBOSITY."""

  def filter(self, record: logging.LogRecord) -> bool:
    return _verbose(LIBRARY_VERBOSITY) or not _expected(record)


class _FailedSaveTracebacks(logging.Filter):
  """A failed save logs its error three times with tracebacks (~300 lines) before the caller
  gets it: the records Orbax raises again are dropped, the tracebacks of its other error lines
  cut to their first line. Kept whole with --verbosity=1 or ATTENTION_JAX_TRACEBACK=1."""

  def filter(self, record: logging.LogRecord) -> bool:
    if (
      record.exc_info
      and "/orbax/" in record.pathname
      and not _verbose()
      and not os.environ.get(TRACEBACK_ENV)
    ):
      if (os.path.basename(record.pathname), record.funcName) in _ORBAX_RERAISED:
        return False
      error = record.exc_info[1]
      record.msg = f"{record.getMessage()} ({first_line(error) if error else 'see above'})"
      record.args, record.exc_info, record.exc_text = None, None, None
    return True


class _LibraryChatter(logging.Filter):
  """Drops the INFO and DEBUG lines and expected warnings of libraries below LIBRARY_VERBOSITY,
  whichever logger they come through (JAX logs through its own); this project's own lines pass."""

  def filter(self, record: logging.LogRecord) -> bool:
    path = record.pathname
    ours = path.startswith(PROJECT_ROOT) and "site-packages" not in path
    if ours or _verbose(LIBRARY_VERBOSITY):
      return True
    return record.levelno >= logging.WARNING and not _expected(record)


def _install(target: logging.Filterer, kind: type[logging.Filter]) -> None:
  if not any(isinstance(f, kind) for f in target.filters):
    target.addFilter(kind())


def quiet_library_logs() -> None:
  """On absl's logger, through which JAX, Orbax and this project log: drops the expected library
  warnings below LIBRARY_VERBOSITY and cuts Orbax's failed-save tracebacks to one line below
  verbosity 1. Idempotent; what the command lines install too, for Python users who want the
  same (the library never calls it)."""
  absl_logger = logging.getLogger("absl")
  _install(absl_logger, _ExpectedWarnings)
  _install(absl_logger, _FailedSaveTracebacks)


def command_line_logs() -> None:
  """The command lines' policy (cli.app.run, once absl.app runs): `quiet_library_logs()`, and on
  absl's handler, through which every logger's records pass, the libraries' INFO and DEBUG lines
  dropped below LIBRARY_VERBOSITY; keeps TensorFlow's C++ INFO and WARNING lines (TFDS imports
  it) off unless the environment asks for them. Idempotent."""
  quiet_library_logs()
  _install(absl_logging.get_absl_handler(), _LibraryChatter)
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
