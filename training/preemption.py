"""Preemption: SIGTERM / SIGINT stop training after the current step with a save, and a watchdog
ends a process that does not stop.

    preemption = Preemption(timeout_s=config.stop_timeout_s)
    ...
    if preemption.requested(step):   # all processes agree on the step
      save and return
    preemption.close()
"""

from __future__ import annotations

import signal
import socket
import threading
import time

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from core import ending


class Preemption:
  """Records SIGTERM/SIGINT so the loop can save and exit after the current step (with several
  processes: after the next step that is a multiple of MULTIHOST_EVERY). A second signal raises
  KeyboardInterrupt: no new save (one already in flight is finished), the last finished checkpoint
  stays as it was. `close()` puts the previous handlers back.

  Python runs signal handlers only between bytecodes of the main thread, so a process stuck in a
  C++ call (a collective another process never joins) would ignore both signals. A watchdog thread
  therefore hears every signal through `signal.set_wakeup_fd`, which the C-level handler writes to
  at once: if the process is still training `timeout_s` seconds after the first stop signal (at
  most 30 s after a second one), it ends the process through the command line's exit
  (core/ending.py) with a line and status 128 + signal number, as the default action would.
  Checkpoint writes are atomic, so the last finished checkpoint survives. `timeout_s=0` disables
  the watchdog."""

  SECOND_SIGNAL_TIMEOUT_S = 30.0

  def __init__(self, timeout_s: float = 0.0):
    self.signal = None
    self._previous = {
      sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)
    }
    self._watchdog = None
    if timeout_s > 0:
      self._watchdog = StopWatchdog(timeout_s, self.SECOND_SIGNAL_TIMEOUT_S)

  def _handle(self, signum, frame):
    del frame
    name = signal.Signals(signum).name
    if self.signal is not None:
      self.close()
      raise KeyboardInterrupt(f"second stop signal ({name}): stopped without saving")
    self.signal = name
    logging.warning(
      "%s received: saving and stopping after this step (send it again to stop without a new save)",
      name,
    )

  def close(self):
    if self._watchdog is not None:
      self._watchdog.close()
      self._watchdog = None
    for sig, handler in self._previous.items():
      if handler is not None:  # None: installed from C, cannot be put back from Python
        signal.signal(sig, handler)
    self._previous = {}

  # Several processes must agree to stop at the same step, which takes a collective that waits
  # for the queued steps; it runs every this many steps so that it does not stall each one.
  MULTIHOST_EVERY = 10

  def requested(self, step: int) -> bool:
    if jax.process_count() == 1:
      return self.signal is not None
    if step % self.MULTIHOST_EVERY:
      return False
    flags_ = multihost_utils.process_allgather(np.int32(self.signal is not None))
    return bool(np.max(flags_))


class StopWatchdog:
  """The thread behind `Preemption`'s timeout: reads signal numbers from a wakeup socket and
  ends the process (core/ending.py: the command line's exit) when a stop signal has gone
  unanswered for too long."""

  def __init__(self, timeout_s: float, second_timeout_s: float):
    self._timeout_s, self._second_timeout_s = timeout_s, second_timeout_s
    self._reader, self._writer = socket.socketpair()
    self._writer.setblocking(False)
    self._closed = threading.Event()
    self._previous_fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
    self._thread = threading.Thread(target=self._watch, name="stop-watchdog", daemon=True)
    self._thread.start()

  def _watch(self):
    stops, deadline, started, signum = (signal.SIGTERM, signal.SIGINT), None, 0.0, 0
    while True:
      self._reader.settimeout(None if deadline is None else max(0.0, deadline - time.monotonic()))
      try:
        data = self._reader.recv(64)
      except TimeoutError:
        data = None
      except OSError:
        return
      if self._closed.is_set() or data == b"":
        return
      if data is None:
        name = signal.Signals(signum).name
        ending.end_process(
          128 + signum,
          f"{name} received {deadline - started:.0f} s ago and the process has not stopped "
          f"(stuck in a collective or a save?): exiting with status {128 + signum} without a new "
          "checkpoint; the last finished one is intact",
        )
        return
      for number in data:
        if number not in stops:
          continue
        now = time.monotonic()
        if deadline is None:
          started, deadline, signum = now, now + self._timeout_s, number
        else:
          deadline = min(deadline, now + self._second_timeout_s)

  def close(self):
    self._closed.set()
    signal.set_wakeup_fd(self._previous_fd)
    self._writer.close()  # wakes the thread: recv returns b""
    self._thread.join(timeout=5)
    self._reader.close()
