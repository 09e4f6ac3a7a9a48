"""The threads of a failed asynchronous Orbax save, which would keep the process alive for
Orbax's 300 s coordination timeout after the error (used by training/checkpoint.py). What Orbax
logs on the way (its tracebacks, its warnings) is the logging policy's: core/logs.py.
"""

from __future__ import annotations

import threading
import warnings

# Orbax offers no public way to release the threads of a failed asynchronous save (see
# release_failed_save_threads): its future module is used as orbax-checkpoint 0.12.8 has it, and
# tests/test_checkpoint.py fails if an upgrade changes it.
from orbax.checkpoint._src.futures import future as orbax_future


def release_failed_save_threads() -> None:
  """Lets the threads of a failed asynchronous save end now. Each of Orbax's commit threads
  first waits for the signals of the steps before it (the step folder's creation, say); when such
  a step failed, the signal never comes and the thread, not a daemon, waits Orbax's coordination
  timeout (300 s), keeping the process alive after the error. Cancelled and sent the signals it
  waits for, each returns without writing anything."""
  for thread in threading.enumerate():
    if isinstance(thread, orbax_future._SignalingThread) and thread.is_alive():
      thread.cancel()
      orbax_future.set_signals(thread._receive_signals, operation_id=thread._operation_id)
  # Their coroutines, never run, would each print a RuntimeWarning when the process exits.
  warnings.filterwarnings("ignore", "coroutine .* was never awaited", RuntimeWarning)
