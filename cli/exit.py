"""The one way a process of this project ends at once, without Python's shutdown: the command
lines own it, the library asks for it (core/ending.py).

    ending.install(ending_line("train.py"))   # cli.app.run, while a command line's main runs
    exit_now(0)                               # cli/coordination_service.py's child

Used where a normal exit could hang: a thread must end the process while the main thread is
stuck in a C++ call (a collective that a lost process never joins, a save that never returns),
or a coordination service's child must leave without its service's shutdown, which would wait
for clients that are gone.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NoReturn


def exit_now(status: int) -> NoReturn:
  """Ends the process with `status` at once: no `atexit`, no `finally`, no buffered output
  flushed."""
  os._exit(status)


def ending_line(prog: str) -> Callable[[int, str], NoReturn]:
  """`end(status, why)` for core/ending.py: writes `<prog>: error: <why>` (the command lines' one
  line) to stderr unbuffered, then `exit_now(status)`."""

  def end(status: int, why: str) -> NoReturn:
    os.write(2, f"{prog}: error: {why}\n".encode())
    exit_now(status)

  return end
