"""Where a decoding run's time goes: start-up, restore, tracing and compiling (or loading compiled
programs from the persistent cache), translating and scoring, for decode.py's log at
--verbosity=1.

    phases = Phases(started=time.perf_counter())   # taken as the first thing the run does
    with phases.measure("restore"): ...
    with phases.measure("translate"): ...           # JAX's own compile events split this
    logging.vlog(1, "%s", phases.summary())

Inside a measured phase, the time JAX reports (its public `jax.monitoring` events) as tracing,
lowering, compiling or reading the persistent compilation cache (or inference/program_store.py's
folder) is counted as "trace + lower" and
"compile or load" and taken out of that phase, so "translate" is the searching itself.
"""

from __future__ import annotations

import contextlib
import time

import jax

from inference.program_store import LOAD_EVENT

_TRACE = (
  "/jax/core/compile/jaxpr_trace_duration",
  "/jax/core/compile/jaxpr_to_mlir_module_duration",
)
_COMPILE = (
  "/jax/core/compile/backend_compile_duration",  # a persistent-cache hit included
  LOAD_EVENT,  # a compiled program read back by inference/program_store.py
)


class Phases:
  """Seconds per phase, in the order first measured; `started` (a `time.perf_counter()` value)
  counts the time before the first phase as "start-up"."""

  def __init__(self, started: float | None = None):
    self.seconds: dict[str, float] = {}
    self._jax = {"trace + lower": 0.0, "compile or load": 0.0}
    self._started = started
    self._first = None

  def _listen(self, event: str, duration: float, **kwargs) -> None:
    if event in _TRACE:
      self._jax["trace + lower"] += duration
    elif event in _COMPILE:
      self._jax["compile or load"] += duration

  @contextlib.contextmanager
  def measure(self, name: str):
    """Times the block as phase `name` (added to it if measured before), less JAX's tracing and
    compiling within it, which go to their own phases."""
    begin = time.perf_counter()
    if self._first is None:
      self._first = begin
    before = dict(self._jax)
    jax.monitoring.register_event_duration_secs_listener(self._listen)
    try:
      yield
    finally:
      jax.monitoring.unregister_event_duration_listener(self._listen)
      spent = {k: self._jax[k] - before[k] for k in self._jax}
      own = time.perf_counter() - begin - sum(spent.values())
      self.seconds[name] = self.seconds.get(name, 0.0) + max(own, 0.0)
      for key, value in spent.items():
        if value:
          self.seconds[key] = self.seconds.get(key, 0.0) + value

  def summary(self) -> str:
    """'start-up 2.10 s, restore 0.31 s, trace + lower 1.20 s, ...' (start-up first)."""
    parts = dict(self.seconds)
    if self._started is not None and self._first is not None:
      parts = {"start-up": self._first - self._started, **parts}
    return ", ".join(f"{name} {seconds:.2f} s" for name, seconds in parts.items())
