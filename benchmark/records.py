"""What one benchmark measures and reports: the timing of a `Runner`'s calls (the first,
compiling one apart), the record fields of each mode (TRAIN_FIELDS, DECODE_FIELDS,
CTRANSLATE2_FIELDS), the machine they ran on, and the optional profiler trace.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import pathlib
import time
from collections.abc import Callable
from typing import Any

import jax
import jaxlib
import numpy as np
from absl import logging

from benchmark.options import Options

# The fields of every record: what ran, and how long it took ...
_TIMES = (
  "mode",
  "implementation",
  "config",
  "model_type",
  "compile_s",
  "step_time_s",
  "step_time_p10_s",
  "step_time_p90_s",
)


# ... and on what.
_MACHINE = (
  "dtype",
  "batch_size",
  "seq_len",
  "device_kind",
  "jax_version",
  "jaxlib_version",
  "host_memory",
)


TRAIN_FIELDS = (
  *_TIMES,
  "tokens_per_s",
  "params",
  "model_flops_per_step",
  "achieved_flops_per_s",
  "peak_flops_per_s",
  "peak_flops_per_s_total",
  "peak_source",
  "peak_samples_flops_per_s",
  "mfu",
  "peak_memory_bytes",
  "num_devices",
  "parallelism",
  *_MACHINE,
)


DECODE_FIELDS = (
  *_TIMES,
  "sent_per_s",
  "out_tokens_per_s",
  "params",
  "decode_len",
  "beam_size",
  "decode_cache",
  "peak_memory_bytes",
  "num_devices",
  *_MACHINE,
)


# CTranslate2's decoding records (benchmark/ctranslate2.py): what it computed in, on how many
# threads and replicas, with which matrix library (its CT2_VERBOSE=1 line), and its version.
CTRANSLATE2_FIELDS = (
  *DECODE_FIELDS,
  "compute_type",
  "intra_threads",
  "inter_threads",
  "backend",
  "ctranslate2_version",
)


# ----------------------------------------------------------------------------- measuring
def first_and_warmup(call, warmup: int) -> float:
  """Runs `call` (which must block until its work is done) 1 + warmup times; returns the first
  call's seconds (compilation + one step)."""
  start = time.perf_counter()
  call()
  first = time.perf_counter() - start
  for _ in range(warmup):
    call()
  return first


def time_calls(call, steps: int) -> list[float]:
  """Seconds of each of `steps` calls of `call`."""
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    call()
    times.append(time.perf_counter() - start)
  return times


def time_stats(first: float, times) -> dict:
  """The record's timing fields from the first call's seconds and the timed calls' seconds."""
  median = float(np.median(times))
  return {
    "compile_s": max(first - median, 0.0),  # the first call = compile + one step
    "step_time_s": median,
    "step_time_p10_s": float(np.percentile(times, 10)),
    "step_time_p90_s": float(np.percentile(times, 90)),
  }


def environment(config, devices, options: Options) -> dict:
  return {
    "config": options.config_path,
    "model_type": config.model.type,
    "num_devices": len(devices),
    "dtype": config.model.dtype,
    "batch_size": int(config.bench.batch_size),
    "seq_len": int(config.bench.seq_len),
    "device_kind": devices[0].device_kind,
    "jax_version": jax.__version__,
    "jaxlib_version": jaxlib.__version__,
    "host_memory": options.host_memory,
  }


def count_params(tree) -> int:
  return int(sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(tree)))


_TRACES: list[str] = []  # names of the traces written so far


def maybe_trace(trace_dir: str | None, name: str):
  """A jax.profiler trace context writing to a subfolder of `trace_dir` (one per benchmark), or
  a no-op when `trace_dir` is None."""
  if not trace_dir:
    return contextlib.nullcontext()
  _TRACES.append(name)
  path = pathlib.Path(trace_dir) / f"{len(_TRACES):02d}_{name}"
  logging.info("writing a profiler trace to %s", path)
  # Without Python frames: tracing and compiling the first call would otherwise fill the
  # trace's event buffer before the timed steps' XLA ops (set
  # XLA_FLAGS=--xla_cpu_enable_xprof_traceme=true for those on CPU).
  profile = jax.profiler.ProfileOptions()
  profile.python_tracer_level = 0
  return jax.profiler.trace(str(path), create_perfetto_trace=True, profiler_options=profile)


# ----------------------------------------------------------------------------- runners
@dataclasses.dataclass
class Runner:
  """One implementation's benchmark, built and ready to time: `call()` runs one train step (or
  decodes one batch) and waits for it; `record(first, times)` turns the first call's seconds and
  the timed calls' seconds into the benchmark's record; `name` names its --trace folder; `params`:
  the parameters our decoding runs with (for a peer that exports them), else None."""

  name: str
  call: Callable[[], None]
  record: Callable[[float, Any], dict]
  params: Any = None
