"""One benchmark: a synthetic batch, a `Runner` that runs the real train step (or decodes one
batch) and waits for it, the timing of its calls and the record that comes out (TRAIN_FIELDS,
DECODE_FIELDS).

Batches hold `bench.batch_size` rows of `bench.seq_len` random source and target tokens (no
padding, each ending in EOS); there is no data pipeline. Training runs train.py's step
(`training.build.build_steps`) under the same parallel wrapper (`config.parallelism`,
`config.num_devices`, `config.mesh`). Decoding produces exactly `bench.decode_len` tokens per
sentence (EOS is never chosen) with beam `bench.beam_size` through model/search.py, so every run
does the same work. With `Options.flax_wmt`, google/flax examples/wmt's step or beam search runs
instead (benchmark/flax_wmt.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import pathlib
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from absl import logging

from benchmark import flax_wmt
from benchmark.peak import (
  AUTO,
  MATMUL_SIZE,
  own_peak_memory,
  peak_memory,
  resolve_peak,
  utilization,
)
from cli.errors import RunError, UsageError
from configs import validate
from model import generate, search
from model.build import build_model, init_variables
from model.special_tokens import EOS_ID, PAD_ID
from training import parallel as par
from training.build import build_steps

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


@dataclasses.dataclass(frozen=True)
class Options:
  """What to time and how, as bench.py's flags say (their names in brackets)."""

  mode: str = "train"  # 'train' or 'decode' [--mode]
  steps: int = 20  # timed calls [--steps]
  warmup: int = 3  # untimed calls after the first, compiling one [--warmup]
  decode_cache: bool = True  # decoding with the key/value cache [--decode_cache]
  peak: str = AUTO  # peak FLOP/s per device: auto, measured or a number [--peak]
  matmul_size: int = MATMUL_SIZE  # the measured peak's matrices [--matmul_size]
  trace: str | None = None  # profiler traces of the timed calls go here [--trace]
  flax_wmt: str | None = None  # flax examples/wmt's directory: time its code [--flax_wmt]
  config_path: str | None = None  # the config file, as the record names it [--config]
  host_memory: str = "process default"  # cli/host_memory.py's setting, as records report it


# ----------------------------------------------------------------------------- inputs
def source_ids(rng, rows: int, length: int, vocab: int):
  """[rows, length] int32 random ids in [4, vocab) (no special tokens), the last one EOS."""
  ids = rng.integers(4, vocab, size=(rows, length), dtype=np.int32)
  ids[:, -1] = EOS_ID
  return ids


def synthetic_batch(rng, rows: int, length: int, vocab: int) -> dict:
  """A training batch (training.step.BATCH_KEYS) without padding or packing."""
  positions = np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length)).copy()
  ones = np.ones((rows, length), np.int32)
  return {
    "inputs": source_ids(rng, rows, length, vocab),
    "targets": source_ids(rng, rows, length, vocab),
    "inputs_position": positions,
    "targets_position": positions.copy(),
    "inputs_segmentation": ones,
    "targets_segmentation": ones.copy(),
  }


def check_config(config, mode: str) -> None:
  """Every check of one benchmark's `config` that needs no compiled work, so that a sweep can
  check all its points before running any: configs/validate.py's for `bench_<mode>` and the
  backend, then what is bench's own (the decode position limit; bench.batch_size over the
  data-parallel devices × optim.grad_accum_steps). mode: 'train' or 'decode'. Raises UsageError,
  or ValueError (training.parallel: a mesh that does not fit the devices)."""
  validate.check_config(config, f"bench_{mode}")
  validate.check_backend(config)  # bench runs in one process: the backend may start here
  if mode == "decode":
    decode_len = int(config.bench.decode_len)
    limit = generate.position_limit(build_model(config.model))
    if limit is not None and decode_len > limit:
      raise UsageError(
        f"config error: bench.decode_len={decode_len} is longer than this model's "
        f"position limit {limit}"
      )
    return
  rows, accum = int(config.bench.batch_size), int(config.optim.grad_accum_steps)
  data_parallel = par.data_parallel_size(config)
  if rows % (data_parallel * accum):
    raise UsageError(
      f"bench.batch_size={rows} is not divisible by {data_parallel} data-parallel "
      f"device(s) × optim.grad_accum_steps={accum} = {data_parallel * accum}; change "
      f"bench.batch_size or num_devices"
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


def _environment(config, devices, options: Options) -> dict:
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


def _count(tree) -> int:
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
  the timed calls' seconds into the benchmark's record; `name` names its --trace folder."""

  name: str
  call: Callable[[], None]
  record: Callable[[float, Any], dict]


def train_runner(config, options: Options, flax: bool = False) -> Runner:
  """train.py's step (or, with `flax`, flax examples/wmt's from `options.flax_wmt`) on a
  synthetic [bench.batch_size, bench.seq_len] batch. The record has TRAIN_FIELDS."""
  rows, length = int(config.bench.batch_size), int(config.bench.seq_len)
  memory_before = peak_memory(jax.local_devices())
  batch = synthetic_batch(
    np.random.default_rng(config.seed), rows, length, int(config.model.vocab_size)
  )
  holder = []
  if flax:
    devices = flax_wmt.pmap_devices(config, rows)  # config.num_devices, as our pmap takes them
    call, flax_params = flax_wmt.train_call(flax_wmt.load(options.flax_wmt), config, batch, devices)
    n_params = _count(flax_params)
    implementation, parallelism = "flax examples/wmt", "pmap"
  else:
    _, parallel = build_steps(config)
    devices = (
      list(parallel.mesh.devices.flat) if parallel.mesh is not None else par.local_devices(config)
    )
    rng = jax.random.key(config.seed + 1)
    holder.append(parallel.init_state(jax.random.key(config.seed)))
    n_params = _count(parallel.abstract_state.params)
    implementation, parallelism = "this repository", config.parallelism

    def call():
      holder[0], metrics = parallel.train_step(holder[0], batch, rng)
      jax.block_until_ready((holder[0], metrics))

  def record(first, times):
    rec = {"mode": "train", "implementation": implementation, **time_stats(first, times)}
    rec["tokens_per_s"] = 2 * rows * length / rec["step_time_s"]
    rec["params"] = n_params
    rec.update(
      utilization(
        config, devices, rec["step_time_s"], memory_before, options.peak, options.matmul_size
      ),
      parallelism=parallelism,
      **_environment(config, devices, options),
    )
    holder.clear()  # the state's buffers go before the next benchmark builds its own
    return rec

  return Runner(f"train_{parallelism}_{len(devices)}dev_b{rows}_l{length}", call, record)


def without_eos(step_fn):
  """A model/search.py step function whose EOS logit is -inf: searches never finish early."""

  def step(ids, cache):
    logits, cache = step_fn(ids, cache)
    return logits.at[:, EOS_ID].set(-jnp.inf), cache

  return step


def fixed_length_decoder(model, beam_size: int, decode_len: int, use_cache: bool):
  """A jitted `(params, inputs [batch, src_len]) -> ids [batch, decode_len]` that runs
  model/generate.py's step functions under model/search.py's greedy (beam_size 1) or beam search
  with EOS impossible, so it always produces exactly `decode_len` tokens per sentence."""

  def run(params, inputs):
    rows = inputs.shape[0]
    step, cache, grow, segment = generate.decoder_state(
      model, params, inputs, decode_len, use_cache
    )
    if beam_size == 1:
      return search.greedy_search(
        without_eos(step), cache, rows, decode_len, grow=grow, segment=segment
      )
    ids, _ = search.beam_search(
      without_eos(step), cache, rows, decode_len, beam_size=beam_size, grow=grow, segment=segment
    )
    return ids[:, 0]

  return jax.jit(run)


def decode_runner(config, options: Options, flax: bool = False) -> Runner:
  """Fixed-length decoding of random source sentences on one device with model/search.py (or,
  with `flax`, flax examples/wmt's cached beam search from `options.flax_wmt`), with the cache as
  `options.decode_cache` says. The record has DECODE_FIELDS, and building it checks that every
  sentence got bench.decode_len tokens."""
  use_cache = options.decode_cache
  memory_before = peak_memory(jax.local_devices())
  rows, length = int(config.bench.batch_size), int(config.bench.seq_len)
  decode_len, beam = int(config.bench.decode_len), int(config.bench.beam_size)
  model = build_model(config.model)
  device = jax.local_devices()[0]
  inputs = jax.device_put(
    source_ids(np.random.default_rng(config.seed), rows, length, int(config.model.vocab_size)),
    device,
  )
  out = []
  if flax:
    if not use_cache:
      raise UsageError("--flax_wmt decodes only with its cache (--decode_cache=true)")
    if beam == 1:
      raise UsageError("--flax_wmt has only beam search: set config.bench.beam_size >= 2")
    flax_decode, flax_params = flax_wmt.decode_call(
      flax_wmt.load(options.flax_wmt), config, inputs, decode_len, beam
    )
    n_params = _count(flax_params)
    implementation = "flax examples/wmt"

    def call():
      out[:] = [flax_decode()]
  else:
    init = jax.jit(
      lambda rng: nn.unbox(init_variables(model, rng))["params"],
      out_shardings=jax.sharding.SingleDeviceSharding(device),
    )
    params = init(jax.random.key(config.seed))
    n_params = _count(params)
    decode = fixed_length_decoder(model, beam, decode_len, use_cache)
    implementation = "this repository"

    def call():
      out[:] = [decode(params, inputs).block_until_ready()]

  def record(first, times):
    ids = np.asarray(out[0])
    # (flax's search has no EOS here at all, so any id may appear in its rows)
    if ids.shape != (rows, decode_len) or (not flax and np.any((ids == EOS_ID) | (ids == PAD_ID))):
      raise RunError(
        f"fixed-length decoding produced short rows (shape {ids.shape}); "
        f"the timing would not be comparable"
      )
    rec = {"mode": "decode", "implementation": implementation, **time_stats(first, times)}
    rec["sent_per_s"] = rows / rec["step_time_s"]
    rec["out_tokens_per_s"] = rows * decode_len / rec["step_time_s"]
    rec.update(
      params=n_params,
      decode_len=decode_len,
      beam_size=beam,
      decode_cache=use_cache,
      peak_memory_bytes=own_peak_memory(memory_before),
      **_environment(config, [device], options),
    )
    return rec

  return Runner(f"decode_{'cache' if use_cache else 'nocache'}_b{rows}_l{length}", call, record)


def make_runner(config, options: Options, flax: bool) -> Runner:
  """`options.mode`'s runner: train_runner or decode_runner."""
  return (train_runner if options.mode == "train" else decode_runner)(config, options, flax=flax)


def run_benchmark(config, options: Options) -> dict:
  """Times train.py's step or fixed-length decoding (ours, or flax's with `options.flax_wmt`) as
  `options` says; returns the record (TRAIN_FIELDS or DECODE_FIELDS)."""
  check_config(config, options.mode)
  if options.mode == "train":  # the measured peak's first sample, before the timed steps
    resolve_peak(jax.local_devices()[0], config.model.dtype, options.peak, options.matmul_size)
  runner = make_runner(config, options, flax=bool(options.flax_wmt))
  with maybe_trace(options.trace, runner.name):
    first = first_and_warmup(runner.call, options.warmup)
    times = np.asarray(time_calls(runner.call, options.steps))
  return runner.record(first, times)
