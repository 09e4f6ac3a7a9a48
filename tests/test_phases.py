"""inference/phases.py: each phase's seconds, JAX's compile events taken out once even when
several threads report them at the same time."""

import jax

from inference import phases
from inference.program_store import LOAD_EVENT


def test_covered_counts_overlaps_once():
  assert phases.covered([]) == 0.0
  assert phases.covered([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.5, 5.7)]) == 4.0


def test_concurrent_events_count_once_and_leave_the_phase_the_rest():
  """Two 10-second compilations that ended together (two threads) make 10 s of "compile or
  load", not 20; tracing that overlaps them shares the span; the phase keeps what is left."""
  timer = phases.Phases()
  with timer.measure("translate"):
    jax.monitoring.record_event_duration_secs("/jax/core/compile/backend_compile_duration", 10.0)
    jax.monitoring.record_event_duration_secs(LOAD_EVENT, 10.0)
    jax.monitoring.record_event_duration_secs("/jax/core/compile/jaxpr_trace_duration", 5.0)
  seconds = timer.seconds
  assert 9.9 < seconds[phases.COMPILE] + seconds[phases.TRACE] < 10.5
  assert seconds[phases.COMPILE] > seconds[phases.TRACE] > 0
  assert seconds["translate"] == 0.0  # the block itself took far less than the events claim
  with timer.measure("score"):
    pass
  assert list(timer.seconds) == ["translate", phases.TRACE, phases.COMPILE, "score"]
