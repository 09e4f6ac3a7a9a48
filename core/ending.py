"""How a library thread ends the process at once, when the main thread may be stuck in a C++ call
(a collective that a lost process never joins, a hung save) and cannot raise: the command line
owns that exit, the library only asks for it.

    ending.install(end)                  # cli.app.run, while main() runs: end(status, why)
    ending.on_end(release_held_locks)    # what must happen first (training/workdir.py's lock)
    ending.end_process(status, why)      # cluster/distributed.py's watch, the stop watchdog

`end_process` acts once per process: it flushes Python's stdout and stderr, runs the `on_end`
callbacks (each best effort: a failure is one line on stderr), then calls the installed `end`,
which writes `why` as the command line's error line and exits with `status` at once, without
Python's shutdown. Without a command line (the library called from Python: nothing installed)
`why` is written to stderr and the main thread gets a KeyboardInterrupt instead, which ends it
once the call it is in returns: the library never exits its caller's interpreter.
"""

from __future__ import annotations

import _thread
import os
import sys
import threading
from collections.abc import Callable

_END: Callable[[int, str], object] | None = None
_CALLBACKS: list[Callable[[], object]] = []
_ONCE = threading.Lock()


def install(end: Callable[[int, str], object] | None) -> Callable[[int, str], object] | None:
  """Makes `end(status, why)` the process's way to end at once (None: none); returns the one
  installed before."""
  global _END
  previous, _END = _END, end
  return previous


def on_end(callback: Callable[[], object]) -> None:
  """Runs `callback()` before the process ends through `end_process` (once, however often given)."""
  if callback not in _CALLBACKS:
    _CALLBACKS.append(callback)


def end_process(status: int, why: str) -> None:
  """Ends the process through the installed `end` (see the module's docstring); a second call,
  from another thread meanwhile, returns at once."""
  if not _ONCE.acquire(blocking=False):
    return
  try:
    sys.stdout.flush()
    sys.stderr.flush()
  except (OSError, ValueError):
    pass
  for callback in list(_CALLBACKS):
    try:
      callback()
    except Exception as e:  # noqa: BLE001 - the process ends anyway; say what was left undone
      os.write(2, f"(while ending: {type(e).__name__}: {e})\n".encode())
  end = _END
  if end is not None:
    end(status, why)
    return
  os.write(2, f"{why}\n".encode())
  _ONCE.release()  # the caller may go on: a later loss ends it again
  _thread.interrupt_main()
