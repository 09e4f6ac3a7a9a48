"""The run's workdir: checked writable before any work.

check_workdir(workdir)   # creates it; UsageError when it cannot be written
"""

from __future__ import annotations

import pathlib
import tempfile

from cli.errors import UsageError


def check_workdir(workdir: pathlib.Path) -> None:
  """Creates `workdir` if needed and checks that this process can write in it."""
  try:
    workdir.mkdir(parents=True, exist_ok=True)
    # A probe of its own per process: with one shared name, processes of a multi-host job raced
    # (one deleted the file another was about to delete: FileNotFoundError, seen in CI).
    with tempfile.NamedTemporaryFile(dir=workdir, prefix=".write_test-"):
      pass
  except OSError as e:
    raise UsageError(f"--workdir={workdir}: not writable ({e.strerror or e})") from None
