"""Every private name of Orbax this project uses, in one place, with the public API that is
missing. pyproject.toml bounds orbax-checkpoint to the minor version tested, and
tests/test_orbax_private.py checks that each name below still exists and still holds what
`release_failed_save_threads` reads, so that an Orbax upgrade that changes one fails there in one
line naming it, not silently (a process kept alive after a failed save) or at import.

- `orbax.checkpoint._src.futures.future._SignalingThread`: the (non-daemon) thread that runs one
  step of an asynchronous save after waiting for the signals of the steps before it; read:
  `cancel()`, `_receive_signals` and `_operation_id`.
- `orbax.checkpoint._src.futures.future.set_signals`: sends signals for an operation.

Missing: a public way to release the threads of a failed asynchronous save, which otherwise wait
for Orbax's coordination timeout (300 s) before the process can exit.
"""

from __future__ import annotations

import importlib
import threading
import warnings

from cluster import private_names

FUTURE = "orbax.checkpoint._src.futures.future"
# (module, attribute path): the private names used below.
NAMES = (
  (FUTURE, "_SignalingThread"),
  (FUTURE, "_SignalingThread.cancel"),
  (FUTURE, "set_signals"),
)
# What `release_failed_save_threads` reads of each thread, set by `_SignalingThread.__init__`.
THREAD_ATTRIBUTES = ("_receive_signals", "_operation_id")


def missing() -> list[str]:
  """'module.attribute' of each name of NAMES this Orbax does not have."""
  return private_names.missing(NAMES)


def _future_module():
  return importlib.import_module(FUTURE)


def signaling_threads() -> list[threading.Thread]:
  """The live threads of Orbax's asynchronous saves in this process."""
  thread_type = _future_module()._SignalingThread
  return [t for t in threading.enumerate() if isinstance(t, thread_type) and t.is_alive()]


def release_failed_save_threads() -> None:
  """Lets the threads of a failed asynchronous save end now. Each of Orbax's commit threads
  first waits for the signals of the steps before it (the step folder's creation, say); when such
  a step failed, the signal never comes and the thread, not a daemon, waits Orbax's coordination
  timeout, keeping the process alive after the error. Cancelled and sent the signals it waits
  for, each returns without writing anything. Their coroutines, never run, would each print a
  RuntimeWarning when collected: that warning is silenced for the rest of the process."""
  future = _future_module()
  for thread in signaling_threads():
    thread.cancel()
    future.set_signals(thread._receive_signals, operation_id=thread._operation_id)
  warnings.filterwarnings("ignore", "coroutine .* was never awaited", RuntimeWarning)
