"""Where a decoding run's time goes: start-up, restore, tracing and compiling (or loading compiled
programs from the persistent cache), translating and scoring, for decode.py's log at
--verbosity=1.

    phases = Phases(started=time.perf_counter())   # taken as the first thing the run does
    with phases.measure("restore"): ...
    with phases.measure("translate"): ...           # JAX's own compile events split this
    logging.vlog(1, "%s", phases.summary())

Inside a measured phase, the time JAX reports (its public `jax.monitoring` events) as tracing,
lowering, compiling or reading the persistent compilation cache (or inference/program_store.py's
folder) is counted as "trace + lower" and "compile or load" and taken out of that phase, so
"translate" is the searching itself. Events of several threads at once (a file's programs are
fetched together, inference/generator.py) count once: each phase gets the wall time during which
any of its events ran, and where the two overlap they share it in proportion.
"""

from __future__ import annotations

import contextlib
import threading
import time

import jax

from inference.program_store import LOAD_EVENT

TRACE, COMPILE = "trace + lower", "compile or load"
_KIND = {
  "/jax/core/compile/jaxpr_trace_duration": TRACE,
  "/jax/core/compile/jaxpr_to_mlir_module_duration": TRACE,
  "/jax/core/compile/backend_compile_duration": COMPILE,  # a persistent-cache hit included
  LOAD_EVENT: COMPILE,  # a compiled program read back by inference/program_store.py
}


def covered(intervals: list[tuple[float, float]]) -> float:
  """Seconds covered by the union of (start, end) intervals."""
  total, reach = 0.0, float("-inf")
  for start, end in sorted(intervals):
    if end > reach:
      total += end - max(start, reach)
      reach = end
  return total


class Phases:
  """Seconds per phase, in the order first measured; `started` (a `time.perf_counter()` value)
  counts the time before the first phase as "start-up"."""

  def __init__(self, started: float | None = None):
    self.seconds: dict[str, float] = {}
    self._events: list[tuple[str, float, float]] = []  # (kind, start, end), from any thread
    self._lock = threading.Lock()
    self._started = started
    self._first = None

  def _listen(self, event: str, duration: float, **kwargs) -> None:
    kind = _KIND.get(event)
    if kind is not None:  # JAX reports an event as it ends
      end = time.perf_counter()
      with self._lock:
        self._events.append((kind, end - duration, end))

  @contextlib.contextmanager
  def measure(self, name: str):
    """Times the block as phase `name` (added to it if measured before), less JAX's tracing and
    compiling within it, which go to their own phases."""
    begin = time.perf_counter()
    if self._first is None:
      self._first = begin
    with self._lock:
      first_event = len(self._events)
    jax.monitoring.register_event_duration_secs_listener(self._listen)
    try:
      yield
    finally:
      jax.monitoring.unregister_event_duration_listener(self._listen)
      with self._lock:
        events = self._events[first_event:]
      spans = [(start, end) for _, start, end in events]
      busy = covered(spans)
      own = {
        kind: covered([(s, e) for k, s, e in events if k == kind]) for kind in (TRACE, COMPILE)
      }
      scale = busy / sum(own.values()) if sum(own.values()) > busy > 0 else 1.0
      self._add(name, max(time.perf_counter() - begin - busy, 0.0))
      for kind, seconds in own.items():
        if seconds:
          self._add(kind, seconds * scale)

  def _add(self, name: str, seconds: float) -> None:
    self.seconds[name] = self.seconds.get(name, 0.0) + seconds

  def summary(self) -> str:
    """'start-up 2.10 s, restore 0.31 s, trace + lower 1.20 s, ...' (start-up first)."""
    parts = dict(self.seconds)
    if self._started is not None and self._first is not None:
      parts = {"start-up": self._first - self._started, **parts}
    return ", ".join(f"{name} {seconds:.2f} s" for name, seconds in parts.items())
