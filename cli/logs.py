"""Logging of the command lines: this project's lines at INFO, libraries' INFO chatter hidden."""

from __future__ import annotations

import logging


class _DropLibraryInfo:
  """Filters INFO-level chatter from libraries (Orbax logs every file it renames)."""

  def __init__(self, prefixes=("orbax", "tensorflow_datasets", "jax")):
    self.prefixes = prefixes

  def filter(self, record) -> bool:
    if record.levelno > 20:
      return True
    return not any(f"/{p}/" in record.pathname for p in self.prefixes)


def quiet_library_logs() -> None:
  """Keeps this project's INFO lines and library warnings; drops library INFO lines."""
  logging.getLogger("absl").addFilter(_DropLibraryInfo())
