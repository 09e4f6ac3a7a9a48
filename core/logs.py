"""What the command lines log: this project's lines (progress, records, warnings that concern the
user) at the default verbosity; libraries' chatter (their INFO lines, such as Orbax's per-save and
per-restore lines and JAX's probe of a TPU backend, and the warnings that describe expected
states, such as Orbax's missing-metadata warning on restore) only with `--verbosity=1` (absl's
`-v 1`) or higher.
"""

from __future__ import annotations

import logging
import os
import pathlib

from absl import logging as absl_logging

PROJECT_ROOT = str(pathlib.Path(__file__).resolve().parents[1])

# Library warnings that are not problems here, hidden at the default verbosity.
EXPECTED_WARNINGS = (
  "Unable to initialize backend",  # JAX probing for a TPU or GPU it does not find
  "Metadata file does not exist",  # Orbax restoring a checkpoint written without one
)


class _LibraryChatter(logging.Filter):
  def filter(self, record: logging.LogRecord) -> bool:
    if absl_logging.get_verbosity() >= 1:
      return True
    path = record.pathname
    if path.startswith(PROJECT_ROOT) and "site-packages" not in path:
      return True  # this project's own line
    if record.levelno < logging.WARNING:
      return False
    message = record.getMessage()
    return not any(text in message for text in EXPECTED_WARNINGS)


class _ExpectedWarnings(logging.Filter):
  def filter(self, record: logging.LogRecord) -> bool:
    if absl_logging.get_verbosity() >= 1 or record.levelno != logging.WARNING:
      return True
    return not any(text in record.getMessage() for text in EXPECTED_WARNINGS)


def hide_expected_warnings() -> None:
  """For library use (the Python API) where the command lines' filter is not installed: drops
  only the EXPECTED_WARNINGS that libraries log through absl (its logger), below verbosity 1."""
  absl_logger = logging.getLogger("absl")
  if not any(isinstance(f, _ExpectedWarnings) for f in absl_logger.filters):
    absl_logger.addFilter(_ExpectedWarnings())


def quiet_library_logs() -> None:
  """Installs the filter on absl's handler, through which every logger's records pass once
  absl.app runs (idempotent); keeps TensorFlow's C++ INFO and WARNING lines (TFDS imports it) off
  unless the environment asks for them."""
  handler = absl_logging.get_absl_handler()
  if not any(isinstance(f, _LibraryChatter) for f in handler.filters):
    handler.addFilter(_LibraryChatter())
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
