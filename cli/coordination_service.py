"""The program of the child process that serves a multi-process job's coordination service
(cluster/coordinator.py): process 0 of train.py starts it with `command()` and four arguments
(bind address, process count, heartbeat timeout in seconds, linger in seconds); not a command for
users. It owns how the child ends: when process 0 is gone, without Python's shutdown, whose stop
of the service would wait for the clients that are gone.
"""

from __future__ import annotations

import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def command() -> list[str]:
  """The child's command line, without its four arguments; it finds this project wherever the
  parent runs from."""
  code = (
    f"import sys; sys.path.insert(0, {str(REPO)!r}); "
    "from cli.coordination_service import main; main()"
  )
  return [sys.executable, "-c", code]


def main() -> None:
  from cli.exit import exit_now
  from cluster.coordinator import serve

  if serve(sys.argv[1:5]) is not None:
    exit_now(0)
