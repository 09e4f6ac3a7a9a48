"""What Orbax does around a checkpoint that a run must neither show nor wait for (used by
training/checkpoint.py): the ~300 lines of tracebacks a failed save logs before the caller gets
its error, the threads of a failed asynchronous save that would keep the process alive for
Orbax's 300 s coordination timeout, and the warning at every save without metrics.
"""

from __future__ import annotations

import logging as std_logging
import os
import threading
import warnings

from absl import logging

# Orbax offers no public way to release the threads of a failed asynchronous save (see
# release_failed_save_threads): its future module is used as orbax-checkpoint 0.12.8 has it, and
# tests/test_checkpoint.py fails if an upgrade changes it.
from orbax.checkpoint._src.futures import future as orbax_future

from core.errors import TRACEBACK_ENV, first_line


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


# Where Orbax logs an error with its traceback and then raises it to the caller, which reports it.
_ORBAX_RERAISED = {
  ("future.py", "run"),  # a commit thread's error, raised again by its future
  ("async_checkpointer.py", "_thread_func"),  # the same, raised again by wait_until_finished
  ("checkpoint_manager.py", "wait_until_finished"),
}


class _FailedSaveTracebacks(std_logging.Filter):
  """A failed save logs its error three times with tracebacks (~300 lines) before the caller
  gets it: the records Orbax raises again are dropped, the tracebacks of its other error lines
  cut to their first line. Kept whole with --verbosity=1 or ATTENTION_JAX_TRACEBACK=1."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    if (
      record.exc_info
      and "/orbax/" in record.pathname
      and logging.get_verbosity() < 1
      and not os.environ.get(TRACEBACK_ENV)
    ):
      if (os.path.basename(record.pathname), record.funcName) in _ORBAX_RERAISED:
        return False
      error = record.exc_info[1]
      record.msg = f"{record.getMessage()} ({first_line(error) if error else 'see above'})"
      record.args, record.exc_info, record.exc_text = None, None, None
    return True


def quiet_failed_save_tracebacks():
  absl_logger = std_logging.getLogger("absl")
  if not any(isinstance(f, _FailedSaveTracebacks) for f in absl_logger.filters):
    absl_logger.addFilter(_FailedSaveTracebacks())


class _DropUnscoredSaveWarning:
  """Orbax warns at every save without metrics once best_fn is set; here only evaluation steps
  carry a BLEU, so the other saves are expected."""

  def filter(self, record) -> bool:
    return "did not provide metrics" not in record.getMessage()


def quiet_unscored_save_warning():
  absl_logger = std_logging.getLogger("absl")
  if not any(isinstance(f, _DropUnscoredSaveWarning) for f in absl_logger.filters):
    absl_logger.addFilter(_DropUnscoredSaveWarning())
