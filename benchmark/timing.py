"""One benchmark as bench.py asks for it: the config checked, the runner of the train step (or of
decoding: benchmark/decoding.py) built and timed, the record returned (benchmark/records.py).

Batches hold `bench.batch_size` rows of `bench.seq_len` random source and target tokens (no
padding, each ending in EOS); there is no data pipeline. Training runs train.py's step
(`training.run_steps.build_steps`) under the same parallel wrapper (`config.parallelism`,
`config.num_devices`, `config.mesh`). Decoding produces exactly `bench.decode_len` tokens per
sentence (EOS is never chosen) with beam `bench.beam_size` through model/search.py, so every run
does the same work. With `Options.flax_wmt`, google/flax examples/wmt's step or beam search runs
instead (benchmark/flax_wmt.py); with `Options.ctranslate2`, CTranslate2's beam search on our
model's own parameters (benchmark/ctranslate2.py).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from benchmark import flax_wmt
from benchmark.decoding import ctranslate2_runners, decode_runner, source_ids
from benchmark.options import Options
from benchmark.peak import (
  peak_memory,
  resolve_peak,
  utilization,
)
from benchmark.records import (
  Runner,
  count_params,
  environment,
  first_and_warmup,
  maybe_trace,
  time_calls,
  time_stats,
)
from core.errors import UsageError
from training import parallel as par
from training import validate
from training.run_steps import build_steps


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
  check all its points before running any: training/validate.py's for `bench_<mode>` and the
  backend, then what is bench's own (bench.batch_size over the data-parallel devices ×
  optim.grad_accum_steps, when training). mode: 'train' or 'decode'. Raises UsageError,
  or ValueError (training.parallel: a mesh that does not fit the devices)."""
  validate.check_config(config, f"bench_{mode}")
  validate.check_backend(config)  # bench runs in one process: the backend may start here
  if mode == "decode":
    return
  rows, accum = int(config.bench.batch_size), int(config.optim.grad_accum_steps)
  data_parallel = par.data_parallel_size(config)
  if rows % (data_parallel * accum):
    raise UsageError(
      f"bench.batch_size={rows} is not divisible by {data_parallel} data-parallel "
      f"device(s) × optim.grad_accum_steps={accum} = {data_parallel * accum}; change "
      f"bench.batch_size or num_devices"
    )


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
    n_params = count_params(flax_params)
    implementation, parallelism = "flax examples/wmt", "pmap"
  else:
    _, parallel = build_steps(config)
    devices = (
      list(parallel.mesh.devices.flat) if parallel.mesh is not None else par.local_devices(config)
    )
    rng = jax.random.key(config.seed + 1)
    holder.append(parallel.init_state(jax.random.key(config.seed)))
    n_params = count_params(parallel.abstract_state.params)
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
      **environment(config, devices, options),
    )
    holder.clear()  # the state's buffers go before the next benchmark builds its own
    return rec

  return Runner(f"train_{parallelism}_{len(devices)}dev_b{rows}_l{length}", call, record)


def make_runner(config, options: Options, flax: bool) -> Runner:
  """`options.mode`'s runner: train_runner or decode_runner."""
  return (train_runner if options.mode == "train" else decode_runner)(config, options, flax=flax)


def make_runners(config, options: Options) -> list[Runner]:
  """The runners a paired benchmark alternates: ours first, then each peer: flax examples/wmt
  (`options.flax_wmt`), or CTranslate2 at each of `options.ctranslate2_compute_types` (decoding
  our runner's own parameters)."""
  ours = make_runner(config, options, flax=False)
  if options.ctranslate2:
    return [ours, *ctranslate2_runners(config, options, ours.params)]
  return [ours, make_runner(config, options, flax=True)]


def run_benchmark(config, options: Options) -> dict:
  """Times train.py's step or fixed-length decoding (ours, flax's with `options.flax_wmt`, or
  CTranslate2's at the first of `options.ctranslate2_compute_types` with `options.ctranslate2`,
  in each of its threadings) as `options` says; returns the record (TRAIN_FIELDS, DECODE_FIELDS
  or CTRANSLATE2_FIELDS: CTranslate2's fastest threading)."""
  check_config(config, options.mode)
  if options.mode == "train":  # the measured peak's first sample, before the timed steps
    resolve_peak(jax.local_devices()[0], config.model.dtype, options.peak, options.matmul_size)
  if options.ctranslate2:
    alone = dataclasses.replace(
      options, ctranslate2_compute_types=tuple(options.ctranslate2_compute_types[:1])
    )
    runners = ctranslate2_runners(config, alone)  # each threading: the fastest is the record
  else:
    runners = [make_runner(config, options, flax=bool(options.flax_wmt))]
  found = []
  for runner in runners:
    with maybe_trace(options.trace, runner.name):
      first = first_and_warmup(runner.call, options.warmup)
      times = np.asarray(time_calls(runner.call, options.steps))
    found.append(runner.record(first, times))
  return min(found, key=lambda record: record["step_time_s"])
