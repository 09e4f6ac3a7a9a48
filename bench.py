"""Benchmarks the real train step (or decoding) on synthetic batches: step time, throughput, MFU.

    python bench.py --config=configs/wmt14_ende_base.py --json=base.json
    python bench.py --config=configs/tiny.py --config.model.vocab_size=8000 --mode=decode
    python bench.py --config=configs/tiny.py --config.model.vocab_size=8000 --sweep=devices \
        --json=devices.json   # also writes devices.png

Batches hold `bench.batch_size` rows of `bench.seq_len` random source and target tokens (no
padding, each ending in EOS); there is no data pipeline. Training runs train.py's step under the
same parallel wrapper (`config.parallelism`, `config.num_devices`, `config.mesh`). Decoding
produces exactly `bench.decode_len` tokens per sentence (EOS is never chosen) with beam
`bench.beam_size` through model/search.py, so every run does the same work.

MFU = achieved model FLOP/s / (peak FLOP/s per device × devices), with the model FLOPs of
training/flops.py and the device's datasheet peak for the dtype, or, for a device not in the
table, the best rate of a large matrix product measured on one device, sampled before and after
the timed steps (`peak_source` says which; `peak_samples_flops_per_s` has the samples).
In the record, `achieved_flops_per_s` is the total over all devices, `peak_flops_per_s` is per
device and `peak_flops_per_s_total` is that × num_devices, so mfu = achieved / peak total.
On a CPU, --sweep=devices simulates 8 devices (they share the host's cores). Every sweep point's
config is checked before the first runs; a sweep that fails part-way still writes the points done
(and the error) to --json.

--flax_wmt=<dir> times google/flax examples/wmt's step or beam search instead of ours;
--paired with it times both in one process, alternately (--rounds rounds of --steps each), and
reports both records and `speedup` = flax's median step time / ours; --paired
--separate_processes alternates whole runs instead, each side in its own process with its own
out-of-the-box host-memory setting:

    python bench.py --config=configs/bench_tiny.py --flax_wmt=flax-0.12.8/examples/wmt --paired
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any


def _simulate_cpu_devices(argv: list[str]) -> None:
  """--sweep=devices on a CPU needs several devices; XLA makes them only if told before JAX is
  imported. (The flag changes nothing on GPUs and TPUs.)"""
  wants = "--sweep=devices" in argv or any(
    a == "--sweep" and b == "devices" for a, b in zip(argv, argv[1:])
  )
  flag = "--xla_force_host_platform_device_count"
  if wants and flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {flag}=8").strip()


# training/host_memory.py: whether this process keeps freed host memory (reported as
# `host_memory`); run as a script it does, before JAX starts its threads, unless the environment
# sets its own malloc options.
HOST_MEMORY = "process default"
if __name__ == "__main__":
  _simulate_cpu_devices(sys.argv)
  from training.host_memory import keep_freed_memory

  if keep_freed_memory():
    HOST_MEMORY = "kept"

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "Config file (configs/*.py).", lock_config=True
)
_MODE = flags.DEFINE_enum("mode", "train", ["train", "decode"], "What to time.")
_STEPS = flags.DEFINE_integer("steps", 20, "Timed steps (decode: timed batches).", lower_bound=1)
_WARMUP = flags.DEFINE_integer(
  "warmup", 3, "Untimed steps after the first (compiling) one.", lower_bound=0
)
_JSON = flags.DEFINE_string("json", None, "Write the results to this JSON file.")
_SWEEP = flags.DEFINE_enum(
  "sweep",
  None,
  ["devices", "seq_len", "batch"],
  "Repeat the benchmark over device counts (pmap and mesh), sequence "
  "lengths or batch sizes, and plot it.",
)
_SWEEP_VALUES = flags.DEFINE_list(
  "sweep_values",
  None,
  "The swept values (default: devices 1,2,4,8; seq_len "
  "16,32,64,128,256 up to model.max_len; batch 4,8,16,32).",
)
_PLOT_FROM = flags.DEFINE_list(
  "plot_from",
  None,
  "Plot these saved --sweep JSON files together into --plot (no "
  "benchmark runs), e.g. the seq_len sweeps of two model types.",
)
_SWEEP_PARALLELISM = flags.DEFINE_list(
  "sweep_parallelism", ["pmap", "mesh"], "--sweep=devices: the parallelism modes to run."
)
_PLOT = flags.DEFINE_string(
  "plot", None, "Sweep plot PNG (default: the --json path with .png, else bench_<sweep>.png)."
)
_DECODE_CACHE = flags.DEFINE_bool(
  "decode_cache",
  True,
  "--mode=decode: use the key/value cache (false re-runs the "
  "whole decoder on the prefix every step).",
)
_PEAK = flags.DEFINE_string(
  "peak",
  "auto",
  "Peak FLOP/s per device: 'auto' (datasheet if the "
  "device and dtype are known, else measured), 'measured', or a number.",
)
_MATMUL_SIZE = flags.DEFINE_integer(
  "matmul_size", 2048, "Side of the square matrices of the measured peak.", lower_bound=64
)
_TRACE = flags.DEFINE_string(
  "trace",
  None,
  "Write a jax.profiler trace of the timed steps to this "
  "directory (TensorBoard's profiler, or perfetto_trace.json.gz in "
  "ui.perfetto.dev).",
)
_FLAX_WMT = flags.DEFINE_string(
  "flax_wmt",
  None,
  "Time google/flax examples/wmt's own train step "
  "or beam search (its directory, e.g. from the flax sdist) on the "
  "same model shape and batch instead of ours (analysis/flax_wmt.py).",
)
_PAIRED = flags.DEFINE_bool(
  "paired",
  False,
  "With --flax_wmt: time this repository's step (or "
  "decoding) and flax's alternately in one process, --rounds rounds of "
  "--steps each, and report both and their speed ratio. Both meet the "
  "machine's slow and fast moments alike, so the ratio is steadier than "
  "that of two separate runs.",
)
_ROUNDS = flags.DEFINE_integer(
  "rounds",
  6,
  "--paired: rounds of --steps timed calls per implementation; the order swaps every round.",
  lower_bound=1,
)
_SEPARATE = flags.DEFINE_bool(
  "separate_processes",
  False,
  "With --paired: run each side in a "
  "fresh `python bench.py` process every round, each as it runs by "
  "itself: ours keeps freed host memory (training/host_memory.py), "
  "flax's gets glibc's defaults, as its own main.py runs. Each round "
  "compiles again.",
)
flags.mark_flag_as_required("config")

DEFAULT_VOCAB = 8000
SWEEP_DEFAULTS = {
  "devices": [1, 2, 4, 8],
  "seq_len": [16, 32, 64, 128, 256],
  "batch": [4, 8, 16, 32],
}

# Dense (no sparsity) peak FLOP/s per device from the vendors' datasheets: NVIDIA H100 Tensor
# Core GPU datasheet (SXM: BF16/FP16 989.4, TF32 494.7, FP32 66.9 TFLOPS; the H200 has the same
# compute; PCIe/NVL cards are slower and get measured), NVIDIA A100 datasheet (BF16/FP16 312,
# TF32 156, FP32 19.5 TFLOPS), Google Cloud TPU system architecture pages (BF16: v4 275, v5e 197,
# v5p 459 TFLOPS). A float32 matmul at XLA's default precision runs on these GPUs' tensor cores as
# TF32, so float32 gets the TF32 peak unless jax_default_matmul_precision asks for full float32
# ('highest' / 'float32'), which gets the FP32 rate. Names are matched against
# `device.device_kind`, lowercased: (names, excluded names, {dtype: peak}).
DATASHEET_PEAKS = (
  (
    ("h100", "h200"),
    ("pcie", "nvl"),
    {"bfloat16": 989.4e12, "float16": 989.4e12, "tf32": 494.7e12, "float32": 66.9e12},
  ),
  (("a100",), (), {"bfloat16": 312e12, "float16": 312e12, "tf32": 156e12, "float32": 19.5e12}),
  (("tpu v4",), (), {"bfloat16": 275e12}),
  (("tpu v5 lite", "tpu v5e"), (), {"bfloat16": 197e12}),
  (("tpu v5p", "tpu v5"), ("lite", "v5e"), {"bfloat16": 459e12}),
)

TRAIN_FIELDS = (
  "mode",
  "implementation",
  "config",
  "model_type",
  "compile_s",
  "step_time_s",
  "step_time_p10_s",
  "step_time_p90_s",
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
  "dtype",
  "batch_size",
  "seq_len",
  "device_kind",
  "jax_version",
  "jaxlib_version",
  "host_memory",
)
DECODE_FIELDS = (
  "mode",
  "implementation",
  "config",
  "model_type",
  "compile_s",
  "step_time_s",
  "step_time_p10_s",
  "step_time_p90_s",
  "sent_per_s",
  "out_tokens_per_s",
  "params",
  "decode_len",
  "beam_size",
  "decode_cache",
  "peak_memory_bytes",
  "num_devices",
  "dtype",
  "batch_size",
  "seq_len",
  "device_kind",
  "jax_version",
  "jaxlib_version",
  "host_memory",
)


class Stop(Exception):
  """A clear, expected error: printed as one line, exit status 1."""


# ----------------------------------------------------------------------------- inputs
def source_ids(rng, rows: int, length: int, vocab: int):
  """[rows, length] int32 random ids in [4, vocab) (no special tokens), the last one EOS."""
  import numpy as np

  from model.search import EOS_ID

  ids = rng.integers(4, vocab, size=(rows, length), dtype=np.int32)
  ids[:, -1] = EOS_ID
  return ids


def synthetic_batch(rng, rows: int, length: int, vocab: int) -> dict:
  """A training batch (training.step.BATCH_KEYS) without padding or packing."""
  import numpy as np

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


# ----------------------------------------------------------------------------- measuring
def _first_and_warmup(call, warmup: int) -> float:
  """Runs `call` (which must block until its work is done) 1 + warmup times; returns the first
  call's seconds (compilation + one step)."""
  start = time.perf_counter()
  call()
  first = time.perf_counter() - start
  for _ in range(warmup):
    call()
  return first


def _time_calls(call, steps: int) -> list[float]:
  """Seconds of each of `steps` calls of `call`."""
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    call()
    times.append(time.perf_counter() - start)
  return times


def _timed(call, steps: int, warmup: int):
  """Runs `call` 1 + warmup + steps times; returns the first call's seconds and the last `steps`
  calls' seconds."""
  import numpy as np

  first = _first_and_warmup(call, warmup)
  return first, np.asarray(_time_calls(call, steps))


def _time_stats(first: float, times) -> dict:
  import numpy as np

  median = float(np.median(times))
  return {
    "compile_s": max(first - median, 0.0),  # the first call = compile + one step
    "step_time_s": median,
    "step_time_p10_s": float(np.percentile(times, 10)),
    "step_time_p90_s": float(np.percentile(times, 90)),
  }


def datasheet_peak(device_kind: str, dtype: str) -> float | None:
  """The datasheet dense peak FLOP/s of one device for `dtype`, or None if not in the table."""
  import jax

  kind = device_kind.lower()
  for names, excluded, peaks in DATASHEET_PEAKS:
    if any(n in kind for n in names) and not any(e in kind for e in excluded):
      precision = str(jax.config.jax_default_matmul_precision or "").lower()
      if dtype == "float32" and "tf32" in peaks and precision not in ("highest", "float32"):
        return peaks["tf32"]
      return peaks.get(dtype)
  return None


def measured_peak(device, dtype: str, size: int, trials: int = 7) -> float:
  """Best FLOP/s of a [size, size] @ [size, size] product in `dtype` on `device`. Each trial
  queues enough products to take ~0.2 s and waits once, so call overhead hides behind them."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  rng = np.random.default_rng(0)
  a, b = (
    jax.device_put(rng.standard_normal((size, size)).astype(jnp.dtype(dtype)), device)
    for _ in range(2)
  )
  matmul = jax.jit(lambda x, y: x @ y)
  matmul(a, b).block_until_ready()  # compile
  start = time.perf_counter()
  matmul(a, b).block_until_ready()
  calls = int(min(max(0.2 / max(time.perf_counter() - start, 1e-6), 1), 1000))
  best = math.inf
  for _ in range(trials):
    start = time.perf_counter()
    for _ in range(calls):  # one device runs them in order: waiting for the last waits for all
      out = matmul(a, b)
    out.block_until_ready()
    best = min(best, (time.perf_counter() - start) / calls)
  return 2.0 * size**3 / best


def resolve_peak(device, dtype: str) -> tuple[float, str]:
  """(peak FLOP/s of one device, 'datasheet' | 'measured' | 'given') as --peak asks."""
  choice = _PEAK.value.strip().lower()
  if choice not in ("auto", "measured"):
    try:
      peak = float(choice)
    except ValueError:
      peak = math.nan
    if not (math.isfinite(peak) and peak > 0):
      raise Stop(
        f"--peak={_PEAK.value!r}: expected auto, measured or a positive number of FLOP/s per device"
      )
    return peak, "given"
  if choice == "auto":
    peak = datasheet_peak(device.device_kind, dtype)
    if peak is not None:
      return peak, "datasheet"
  samples = _MEASURED_PEAKS.setdefault(_peak_key(device, dtype), [])
  if len(samples) < PEAK_SAMPLES:
    samples.append(measured_peak(device, dtype, _MATMUL_SIZE.value))
    logging.info(
      "measured peak of %s (%s, %d-wide matmul), sample %d: %.3g FLOP/s",
      device.device_kind,
      dtype,
      _MATMUL_SIZE.value,
      len(samples),
      samples[-1],
    )
    if len(samples) == PEAK_SAMPLES and max(samples) > 1.2 * min(samples):
      logging.warning(
        "the measured matmul rate changed during the run (%s GFLOP/s): the highest "
        "is the peak; the machine was busy or throttled for a while, so step times "
        "may be off too",
        " / ".join(f"{x / 1e9:.0f}" for x in samples),
      )
  return max(samples), "measured"


def peak_samples(device, dtype: str) -> list[float] | None:
  """The measured peak's samples (FLOP/s) for `device` and `dtype`, or None if not measured."""
  return _MEASURED_PEAKS.get(_peak_key(device, dtype))


def _peak_key(device, dtype: str) -> tuple[str, str, int]:
  return device.device_kind, dtype, _MATMUL_SIZE.value


# Measured peaks of this process by (device kind, dtype, matmul size): PEAK_SAMPLES samples, one
# before the first run's timed steps and one after them, and the peak is the highest. On a
# shared or throttled machine a sample can catch a few seconds at half speed (seen on the 2-core
# VM: 105 against 200 GFLOP/s); two samples far apart in time rarely both do. Every later point
# of a sweep is divided by the same yardstick, and the matmul's buffers raise the allocator's
# peak (which never resets) before the first point reads its own.
PEAK_SAMPLES = 2
_MEASURED_PEAKS: dict[tuple[str, str, int], list[float]] = {}


def own_peak_memory(before: int | None) -> int | None:
  """This run's peak device memory: the allocator's peak counts from the start of the process and
  never resets, so it is this run's own only if the run raised it above `before` (the value read
  when the run started). None when the backend reports nothing or an earlier run (a previous
  sweep point) peaked higher. Reads all local devices, as `before` should."""
  import jax

  after = peak_memory(jax.local_devices())
  return after if after is not None and (before is None or after > before) else None


def peak_memory(devices) -> int | None:
  """Largest `peak_bytes_in_use` of `devices` (since the process started), if reported."""
  peaks = []
  for d in devices:
    try:
      stats = d.memory_stats()
    except Exception:  # a backend without memory statistics
      stats = None
    if stats and stats.get("peak_bytes_in_use") is not None:
      peaks.append(int(stats["peak_bytes_in_use"]))
  return max(peaks) if peaks else None


def _config_path() -> str | None:
  """The --config file, or None when bench's functions run without its command line."""
  if not flags.FLAGS.is_parsed():
    return None
  return config_flags.get_config_filename(flags.FLAGS["config"])


def _environment(config, devices) -> dict:
  import jax
  import jaxlib

  return {
    "config": _config_path(),
    "model_type": config.model.type,
    "num_devices": len(devices),
    "dtype": config.model.dtype,
    "batch_size": int(config.bench.batch_size),
    "seq_len": int(config.bench.seq_len),
    "device_kind": devices[0].device_kind,
    "jax_version": jax.__version__,
    "jaxlib_version": jaxlib.__version__,
    "host_memory": HOST_MEMORY,
  }


def _check_lengths(config):
  if int(config.bench.seq_len) < 2:
    raise Stop(f"config error: bench.seq_len={config.bench.seq_len} must be >= 2")
  if int(config.bench.seq_len) > int(config.model.max_len):
    raise Stop(
      f"config error: bench.seq_len={config.bench.seq_len} is longer than "
      f"model.max_len={config.model.max_len}"
    )
  if int(config.bench.batch_size) < 1:
    raise Stop(f"config error: bench.batch_size={config.bench.batch_size} must be positive")


def _check_cudnn(config, mode: str):
  """model.attention_impl='cudnn' (transformer, decoder_only; the recurrent types ignore it)
  needs a GPU, and for training an even bench.seq_len: cuDNN's masked attention takes even
  lengths when training (build_steps asks the same of data.max_len, which bench does not use)."""
  import jax

  if config.model.get("attention_impl") != "cudnn" or config.model.type not in (
    "transformer",
    "decoder_only",
  ):
    return
  if mode == "train" and int(config.bench.seq_len) % 2:
    raise Stop(
      f"config error: model.attention_impl='cudnn' needs an even bench.seq_len when "
      f"training, got {config.bench.seq_len}"
    )
  backend = jax.default_backend()
  if backend != "gpu":
    raise Stop(
      f"config error: model.attention_impl='cudnn' needs an NVIDIA GPU, but JAX's "
      f"backend here is {backend!r}; use model.attention_impl=xla"
    )


def check_config(config, mode: str) -> None:
  """Every check of one benchmark's `config` that needs no compiled work, so that a sweep can
  check all its points before running any. mode: 'train' or 'decode'. Raises Stop, or
  ValueError (training.parallel: a mesh that does not fit the devices)."""
  from training import parallel as par

  _check_lengths(config)
  _check_cudnn(config, mode)
  rows = int(config.bench.batch_size)
  if mode == "decode":
    from model.build import build_model
    from model.generate import position_limit

    decode_len, beam = int(config.bench.decode_len), int(config.bench.beam_size)
    if decode_len < 1 or beam < 1:
      raise Stop(
        f"config error: bench.decode_len={decode_len} and bench.beam_size={beam} must be positive"
      )
    limit = position_limit(build_model(config.model))
    if limit is not None and decode_len > limit:
      raise Stop(
        f"config error: bench.decode_len={decode_len} is longer than this model's "
        f"position limit {limit}"
      )
    return
  accum = int(config.optim.grad_accum_steps)
  if accum < 1:
    raise Stop(f"config error: optim.grad_accum_steps={accum} must be >= 1")
  data_parallel = par.data_parallel_size(config)
  if rows % (data_parallel * accum):
    raise Stop(
      f"bench.batch_size={rows} is not divisible by {data_parallel} data-parallel "
      f"device(s) × optim.grad_accum_steps={accum} = {data_parallel * accum}; change "
      f"bench.batch_size or num_devices"
    )


def _count(tree) -> int:
  import jax

  return int(sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(tree)))


_TRACES: list[str] = []  # names of the traces written so far


def _maybe_trace(name: str):
  """A jax.profiler trace context for --trace (one subfolder per benchmark), else a no-op."""
  import contextlib

  import jax

  if not _TRACE.value:
    return contextlib.nullcontext()
  _TRACES.append(name)
  path = pathlib.Path(_TRACE.value) / f"{len(_TRACES):02d}_{name}"
  logging.info("writing a profiler trace to %s", path)
  # Without Python frames: tracing and compiling the first call would otherwise fill the
  # trace's event buffer before the timed steps' XLA ops (set
  # XLA_FLAGS=--xla_cpu_enable_xprof_traceme=true for those on CPU).
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 0
  return jax.profiler.trace(str(path), create_perfetto_trace=True, profiler_options=options)


# ----------------------------------------------------------------------------- training
@dataclasses.dataclass
class Runner:
  """One implementation's benchmark, built and ready to time: `call()` runs one train step (or
  decodes one batch) and waits for it; `record(first, times)` turns the first call's seconds and
  the timed calls' seconds into the benchmark's record; `name` names its --trace folder."""

  name: str
  call: Callable[[], None]
  record: Callable[[float, Any], dict]


def train_runner(config, flax: bool = False) -> Runner:
  """train.py's step (or, with `flax`, flax examples/wmt's from --flax_wmt) on a synthetic
  [bench.batch_size, bench.seq_len] batch. The record has TRAIN_FIELDS."""
  import jax
  import numpy as np

  from training import parallel as par
  from training.loop import build_steps

  rows, length = int(config.bench.batch_size), int(config.bench.seq_len)
  memory_before = peak_memory(jax.local_devices())
  batch = synthetic_batch(
    np.random.default_rng(config.seed), rows, length, int(config.model.vocab_size)
  )
  holder = []
  if flax:
    from analysis import flax_wmt

    devices = flax_wmt.pmap_devices(config, rows)  # config.num_devices, as our pmap takes them
    call, flax_params = flax_wmt.train_call(_load_flax_wmt(), config, batch, devices)
    n_params = _count(flax_params)
    implementation, parallelism = "flax examples/wmt", "pmap"
  else:
    model, parallel = build_steps(config)
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
    rec = {"mode": "train", "implementation": implementation, **_time_stats(first, times)}
    rec["tokens_per_s"] = 2 * rows * length / rec["step_time_s"]
    rec["params"] = n_params
    rec.update(
      utilization(config, devices, rec["step_time_s"], memory_before),
      parallelism=parallelism,
      **_environment(config, devices),
    )
    holder.clear()  # the state's buffers go before the next benchmark builds its own
    return rec

  return Runner(f"train_{parallelism}_{len(devices)}dev_b{rows}_l{length}", call, record)


def bench_train(config, steps: int, warmup: int) -> dict:
  """Times train.py's step (or flax's, with --flax_wmt) on synthetic batches; returns the record
  (TRAIN_FIELDS)."""
  import jax

  check_config(config, "train")
  # The measured peak's first sample, before the timed steps (utilization takes the second).
  resolve_peak(jax.local_devices()[0], config.model.dtype)
  runner = train_runner(config, flax=bool(_FLAX_WMT.value))
  with _maybe_trace(runner.name):
    first, times = _timed(runner.call, steps, warmup)
  return runner.record(first, times)


def utilization(config, devices, step_time_s: float, memory_before: int | None) -> dict:
  """The train record's memory and FLOP fields for a [bench.batch_size, bench.seq_len] step of
  `step_time_s` on `devices`: peak_memory_bytes, model_flops_per_step, achieved_flops_per_s (all
  devices), peak_flops_per_s (one device), peak_flops_per_s_total (× devices), peak_source and
  mfu = achieved / peak total."""
  from training import flops

  # Read first: resolving the peak may run the measured matmul, which would be counted otherwise.
  memory = own_peak_memory(memory_before)
  rows, length = int(config.bench.batch_size), int(config.bench.seq_len)
  try:
    model_flops = flops.train_flops(config.model, rows, length, length)
  except ValueError as e:
    logging.warning("%s: no MFU", e)
    model_flops = None
  peak, source = resolve_peak(devices[0], config.model.dtype)
  samples = peak_samples(devices[0], config.model.dtype) if source == "measured" else None
  peak_total = peak * len(devices)
  achieved = None if model_flops is None else model_flops / step_time_s
  mfu = None if achieved is None else achieved / peak_total
  if mfu is not None and mfu > 1:
    logging.warning(
      "MFU %.2f > 1: the %s peak %.3g FLOP/s is too low for this device and dtype "
      "(float32 may run as TF32); try --peak=measured",
      mfu,
      source,
      peak,
    )
  return {
    "model_flops_per_step": model_flops,
    "achieved_flops_per_s": achieved,
    "peak_flops_per_s": peak,
    "peak_flops_per_s_total": peak_total,
    "peak_source": source,
    "peak_samples_flops_per_s": None if samples is None else list(samples),
    "mfu": mfu,
    "peak_memory_bytes": memory,
  }


def _load_flax_wmt():
  """flax examples/wmt's modules from --flax_wmt (analysis/flax_wmt.py; its errors are
  ValueErrors that main() prints as one line)."""
  from analysis import flax_wmt

  return flax_wmt.load(_FLAX_WMT.value)


# ----------------------------------------------------------------------------- decoding
def without_eos(step_fn):
  """A model/search.py step function whose EOS logit is -inf: searches never finish early."""
  import jax.numpy as jnp

  from model.search import EOS_ID

  def step(ids, cache):
    logits, cache = step_fn(ids, cache)
    return logits.at[:, EOS_ID].set(-jnp.inf), cache

  return step


def fixed_length_decoder(model, beam_size: int, decode_len: int, use_cache: bool):
  """A jitted `(params, inputs [batch, src_len]) -> ids [batch, decode_len]` that runs
  model/generate.py's step functions under model/search.py's greedy (beam_size 1) or beam search
  with EOS impossible, so it always produces exactly `decode_len` tokens per sentence."""
  import jax

  from model import generate, search

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


def decode_runner(config, use_cache: bool, flax: bool = False) -> Runner:
  """Fixed-length decoding of random source sentences on one device with model/search.py (or,
  with `flax`, flax examples/wmt's cached beam search from --flax_wmt). The record has
  DECODE_FIELDS, and building it checks that every sentence got bench.decode_len tokens."""
  import flax.linen as nn
  import jax
  import numpy as np

  from model.build import build_model, init_variables
  from model.search import EOS_ID, PAD_ID

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
    from analysis import flax_wmt

    if not use_cache:
      raise Stop("--flax_wmt decodes only with its cache (--decode_cache=true)")
    if beam == 1:
      raise Stop("--flax_wmt has only beam search: set config.bench.beam_size >= 2")
    flax_decode, flax_params = flax_wmt.decode_call(
      _load_flax_wmt(), config, inputs, decode_len, beam
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
      raise RuntimeError(
        f"fixed-length decoding produced short rows (shape {ids.shape}); "
        f"the timing would not be comparable"
      )
    rec = {"mode": "decode", "implementation": implementation, **_time_stats(first, times)}
    rec["sent_per_s"] = rows / rec["step_time_s"]
    rec["out_tokens_per_s"] = rows * decode_len / rec["step_time_s"]
    rec.update(
      params=n_params,
      decode_len=decode_len,
      beam_size=beam,
      decode_cache=use_cache,
      peak_memory_bytes=own_peak_memory(memory_before),
      **_environment(config, [device]),
    )
    return rec

  return Runner(f"decode_{'cache' if use_cache else 'nocache'}_b{rows}_l{length}", call, record)


def bench_decode(config, steps: int, warmup: int, use_cache: bool) -> dict:
  """Times fixed-length decoding (ours, or flax's with --flax_wmt) on one device; returns the
  record (DECODE_FIELDS)."""
  check_config(config, "decode")
  runner = decode_runner(config, use_cache, flax=bool(_FLAX_WMT.value))
  with _maybe_trace(runner.name):
    first, times = _timed(runner.call, steps, warmup)
  return runner.record(first, times)


# ----------------------------------------------------------------------------- paired
def _round_order(i: int) -> tuple[int, int]:
  """Which side goes first in round `i` of a paired benchmark: ours (0) in even rounds."""
  return (0, 1) if i % 2 == 0 else (1, 0)


def time_paired(runners: list[Runner], steps: int, warmup: int, rounds: int):
  """Times two runners alternately: each one's first (compiling) call and `warmup` calls, then
  `rounds` rounds of `steps` timed calls of each, A B in even rounds and B A in odd ones, so a
  slow spell of the machine or a drift over the run falls on both alike.

  Returns (first call seconds per runner, timed seconds per runner, per-round ratio of B's
  median step to A's: above 1 when A is faster)."""
  import numpy as np

  firsts = [_first_and_warmup(r.call, warmup) for r in runners]
  times: list[list[float]] = [[] for _ in runners]
  ratios = []
  for i in range(rounds):
    this_round = {}
    for j in _round_order(i):
      this_round[j] = _time_calls(runners[j].call, steps)
      times[j] += this_round[j]
    ratios.append(float(np.median(this_round[1]) / np.median(this_round[0])))
  return firsts, [np.asarray(t) for t in times], ratios


PAIRED_FIELDS = (
  "mode",
  "paired",
  "separate_processes",
  "rounds",
  "steps_per_round",
  "speedup",
  "speedup_min",
  "speedup_max",
  "speedup_per_round",
  "records",
)


def bench_paired(config, mode: str, steps: int, warmup: int, rounds: int, make_runner=None) -> dict:
  """This repository against flax examples/wmt (--flax_wmt) in one process (`time_paired`).
  `make_runner(config, flax)` builds each side (default: train_runner or decode_runner).

  Returns PAIRED_FIELDS: `speedup` = flax's median step time / ours over all rounds (= our
  tokens/s or sentences/s over flax's: same batch), its range over the rounds, and both records
  (whose peak_memory_bytes is null: the two share the process, and its allocator's peak)."""
  import jax

  check_config(config, mode)
  if make_runner is None:
    make_runner = (
      train_runner
      if mode == "train"
      else lambda c, flax: decode_runner(c, _DECODE_CACHE.value, flax=flax)
    )
  if mode == "train":  # the measured peak's first sample, before the timed steps
    resolve_peak(jax.local_devices()[0], config.model.dtype)
  runners = [make_runner(config, flax=False), make_runner(config, flax=True)]
  firsts, times, ratios = time_paired(runners, steps, warmup, rounds)
  records = [
    dict(r.record(first, t), peak_memory_bytes=None) for r, first, t in zip(runners, firsts, times)
  ]
  return {
    "mode": mode,
    "paired": True,
    "separate_processes": False,
    "rounds": rounds,
    "steps_per_round": steps,
    "speedup": records[1]["step_time_s"] / records[0]["step_time_s"],
    "speedup_min": min(ratios),
    "speedup_max": max(ratios),
    "speedup_per_round": ratios,
    "records": records,
  }


# Flags the parent of --separate_processes keeps to itself; each child gets the rest of its
# command line, its own --json and, on flax's side, --flax_wmt.
_PARENT_ONLY_FLAGS = ("paired", "separate_processes", "rounds", "json", "flax_wmt")


def child_argv(argv: list[str]) -> list[str]:
  """`argv` (flags only, no program name) without _PARENT_ONLY_FLAGS, in any of absl's forms:
  --name=value, --name value, and for a boolean --name, --noname."""
  out, i = [], 0
  while i < len(argv):
    arg = argv[i]
    name = arg.lstrip("-").split("=", 1)[0] if arg.startswith("-") else None
    if name and name.startswith("no") and name[2:] in _PARENT_ONLY_FLAGS:
      name = name[2:]
    if name in _PARENT_ONLY_FLAGS:
      i += 2 if not flags.FLAGS[name].boolean and "=" not in arg else 1
      continue
    out.append(arg)
    i += 1
  return out


def flax_environment(environ=os.environ) -> dict:
  """The environment of flax's process under --separate_processes: glibc's default malloc, as
  flax examples/wmt's main.py runs. MALLOC_ARENA_MAX at glibc's own default for 64-bit hosts (8
  per core) changes nothing in glibc but makes training/host_memory.py stand aside. When the
  environment has its own malloc settings, both sides keep those."""
  from training.host_memory import user_settings

  env = dict(environ)
  if not user_settings(env):
    env["MALLOC_ARENA_MAX"] = str(8 * (os.cpu_count() or 1))
  return env


def run_child(argv: list[str], env: dict) -> dict:
  """Runs `python bench.py <argv>` with --json to a temporary file; returns its record. A
  failed run is a Stop with the end of its stderr."""
  with tempfile.TemporaryDirectory() as tmp:
    path = pathlib.Path(tmp) / "record.json"
    command = [sys.executable, str(pathlib.Path(__file__).resolve()), *argv, f"--json={path}"]
    logging.info("running %s", " ".join(command))
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0 or not path.exists():
      tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
      raise Stop(
        f"--separate_processes: `{' '.join(command)}` failed (exit status "
        f"{done.returncode}):\n{tail}"
      )
    return json.loads(path.read_text())


def bench_paired_processes(
  argv: list[str], flax_wmt: str, mode: str, steps: int, rounds: int, run=run_child
) -> dict:
  """This repository against flax examples/wmt, each side in its own process every round (ours
  first in even rounds, flax's first in odd ones), each with its own host-memory setting:
  ours as bench.py sets it, flax's with glibc's defaults (`flax_environment`). `argv`: this
  command line's flags (`steps`: its --steps, each child's timed steps); `run(argv, env)` runs
  one child and returns its record.

  Returns PAIRED_FIELDS, `separate_processes` true, and `round_records` (each side's record of
  every round): `speedup` = flax's median step time over the rounds / ours, `records` each
  side's record of its median round (the lower middle one for an even count)."""
  import numpy as np

  base = child_argv(argv)
  sides = [(base, dict(os.environ)), (base + [f"--flax_wmt={flax_wmt}"], flax_environment())]
  round_records: list[list[dict]] = [[], []]
  for i in range(rounds):
    for j in _round_order(i):
      record = run(*sides[j])
      round_records[j].append(record)
      print(
        f"round {i + 1}/{rounds}: {record.get('implementation')} "
        f"{_fmt(record.get('step_time_s'))} s/step (host memory "
        f"{record.get('host_memory')})",
        flush=True,
      )
  medians = [np.asarray([r["step_time_s"] for r in rs]) for rs in round_records]
  ratios = [float(f / o) for o, f in zip(*medians)]
  middle = [rs[int(np.argsort(t)[(len(t) - 1) // 2])] for rs, t in zip(round_records, medians)]
  return {
    "mode": mode,
    "paired": True,
    "separate_processes": True,
    "rounds": rounds,
    "steps_per_round": steps,
    "speedup": float(np.median(medians[1]) / np.median(medians[0])),
    "speedup_min": min(ratios),
    "speedup_max": max(ratios),
    "speedup_per_round": ratios,
    "records": middle,
    "round_records": round_records,
  }


def print_paired(result: dict) -> None:
  rate = "tokens_per_s" if result["mode"] == "train" else "sent_per_s"
  columns = ["implementation", "step_time_s", "step_time_p10_s", "step_time_p90_s", rate]
  columns += ["mfu"] if result["mode"] == "train" else []
  where = "a process per side and round" if result["separate_processes"] else "one process"
  print(
    f"paired: {result['rounds']} rounds of {result['steps_per_round']} steps each ({where}), "
    f"{result['mode']}, {result['records'][0]['device_kind']}, "
    f"{result['records'][0]['dtype']}"
  )
  _print_table(
    columns + (["host_memory"] if result["separate_processes"] else []), result["records"]
  )
  print(
    f"speedup (flax's step time / ours) {_fmt(result['speedup'])}, per round "
    f"{_fmt(result['speedup_min'])}-{_fmt(result['speedup_max'])}"
  )


# ----------------------------------------------------------------------------- sweeps
def sweep_configs(
  config, kind: str, values: list[str] | None, modes=("pmap", "mesh"), mode: str = "train"
):
  """(value, parallelism, config) of every point of sweep `kind` ('devices': for each
  parallelism in `modes`). Checks every point's config (`check_config`) first and raises Stop
  naming all the points that cannot run. `mode`: 'train' or 'decode'."""
  import jax

  try:
    numbers = [int(v) for v in values] if values else list(SWEEP_DEFAULTS[kind])
  except ValueError:
    raise Stop(f"--sweep_values={','.join(values)}: expected integers") from None
  if not numbers or any(v < 1 for v in numbers):
    raise Stop(f"--sweep_values: expected positive integers, got {numbers}")
  points = []

  def with_(**fields):
    c = config.copy_and_resolve_references()
    c.update_from_flattened_dict(fields)
    return c

  if kind == "devices":
    available = jax.local_device_count()
    too_many = [n for n in numbers if n > available]
    if too_many:
      if values:
        raise Stop(f"--sweep=devices: {too_many} device(s) asked for, this process has {available}")
      logging.warning("--sweep=devices: skipping %s (only %d devices)", too_many, available)
      numbers = [n for n in numbers if n <= available]
    for parallelism in modes:
      if parallelism not in ("pmap", "mesh"):
        raise Stop(f"--sweep_parallelism: {parallelism!r} is not pmap or mesh")
    for parallelism in modes:
      for n in numbers:
        points.append((n, parallelism, with_(parallelism=parallelism, num_devices=n)))
  elif kind == "seq_len":
    limit = int(config.model.max_len)
    if values and max(numbers) > limit:
      raise Stop(f"--sweep=seq_len: {max(numbers)} is longer than model.max_len={limit}")
    numbers = [n for n in numbers if n <= limit]
    points = [(n, config.parallelism, with_(**{"bench.seq_len": n})) for n in numbers]
  else:
    points = [(n, config.parallelism, with_(**{"bench.batch_size": n})) for n in numbers]
  # Every point's config is checked (data-parallel split, mesh shape, lengths...) before any runs.
  bad: dict[str, list[str]] = {}  # error -> the points it stops
  for value, parallelism, c in points:
    try:
      check_config(c, mode)
    except (Stop, ValueError) as e:
      where = (
        f"{parallelism} num_devices={value}"
        if kind == "devices"
        else f"bench.{'seq_len' if kind == 'seq_len' else 'batch_size'}={value}"
      )
      bad.setdefault(str(e), []).append(where)
  if bad:
    count = sum(map(len, bad.values()))
    raise Stop(
      f"--sweep={kind}: {count} of {len(points)} points cannot run (none was run): "
      + "; ".join(f"{', '.join(where)}: {e}" for e, where in bad.items())
    )
  return points


def plot_sweep(
  records: list[dict], kind: str, path: pathlib.Path, title: str, label_of=None
) -> None:
  """Step time (median, p10–p90 bars) and throughput against the swept value, one line per
  `label_of(record)` (default: the parallelism for device sweeps, else the mode)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  x_key = {"devices": "num_devices", "seq_len": "seq_len", "batch": "batch_size"}[kind]
  rate_key = "tokens_per_s" if records[0]["mode"] == "train" else "sent_per_s"
  groups: dict[str, list[dict]] = {}
  if label_of is None:
    label_of = lambda r: r["parallelism"] if kind == "devices" else r["mode"]  # noqa: E731
  for r in records:
    groups.setdefault(label_of(r), []).append(r)
  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
  for label, rs in groups.items():
    xs = [r[x_key] for r in rs]
    median = [r["step_time_s"] for r in rs]
    err = [
      [m - r["step_time_p10_s"] for m, r in zip(median, rs)],
      [r["step_time_p90_s"] - m for m, r in zip(median, rs)],
    ]
    left.errorbar(xs, median, yerr=err, marker="o", capsize=3, label=label)
    right.plot(xs, [r[rate_key] for r in rs], marker="o", label=label)
  for ax, ylabel in ((left, "step time (s), median, p10–p90"), (right, rate_key)):
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r[x_key] for r in records}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel(x_key)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=100)
  plt.close(fig)


# ----------------------------------------------------------------------------- output
def _fmt(value) -> str:
  if isinstance(value, float):
    return f"{value:.4g}"
  return "null" if value is None else str(value)


# What a field of the printed record is measured over, where that is easy to mistake.
FIELD_NOTES = {
  "achieved_flops_per_s": "all devices",
  "peak_flops_per_s": "one device",
  "peak_flops_per_s_total": "all devices",
  "mfu": "achieved / peak total",
}


def print_record(record: dict) -> None:
  width = max(map(len, record))
  for key, value in record.items():
    note = f"  ({FIELD_NOTES[key]})" if key in FIELD_NOTES and value is not None else ""
    print(f"{key:<{width}}  {_fmt(value)}{note}")


def print_sweep(records: list[dict], kind: str) -> None:
  train = records[0]["mode"] == "train"
  columns = [
    "parallelism",
    "num_devices",
    "batch_size",
    "seq_len",
    "compile_s",
    "step_time_s",
    "step_time_p10_s",
    "step_time_p90_s",
  ]
  columns += ["tokens_per_s", "mfu"] if train else ["sent_per_s", "out_tokens_per_s"]
  if not train:
    columns.remove("parallelism")
  print(f"sweep: {kind}")
  _print_table(columns, records)


def _print_table(columns: list[str], records: list[dict]) -> None:
  """One right-aligned row per record, under a header of the column names."""
  cells = [[_fmt(r.get(c)) for c in columns] for r in records]
  widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
  print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
  for row in cells:
    print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def _write_json(path: pathlib.Path, data) -> None:
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
  except OSError as e:
    raise Stop(f"--json={path}: cannot write: {e.strerror or e}") from None


def plot_saved_sweeps(paths: list[str], plot: str) -> None:
  """--plot_from: one plot of several saved sweeps of the same kind (e.g. --sweep=seq_len of two
  model types), one line per config file."""
  sweeps = []
  for path in paths:
    try:
      data = json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError) as e:
      raise Stop(f"--plot_from={path}: cannot read a sweep JSON: {e}") from None
    if not isinstance(data, dict) or "sweep" not in data or not data.get("points"):
      raise Stop(f"--plot_from={path}: not a --sweep JSON (no 'sweep' and 'points')")
    sweeps.append(data)
  kinds = {d["sweep"] for d in sweeps}
  if len(kinds) != 1:
    raise Stop(f"--plot_from: the files sweep different things: {sorted(kinds)}")
  records = []
  for d in sweeps:
    name = pathlib.Path(d.get("config") or "config").stem
    records += [
      dict(r, _label=f"{name} ({r['model_type']})" if r.get("model_type") else name)
      for r in d["points"]
    ]
  kind = kinds.pop()
  first = records[0]
  plot_sweep(
    records,
    kind,
    pathlib.Path(plot),
    f"{first['mode']}, {first['device_kind']}, {first['dtype']}, batch {first['batch_size']}",
    label_of=lambda r: r["_label"],
  )
  print(f"plot: {plot}")


def run_points(points, one, kind: str, mode: str, json_path: str | None) -> list[dict]:
  """Runs `one(config)` for each sweep point (value, parallelism, config); returns the records.
  If a point fails (an error, out of memory, Ctrl-C), the points done so far are written to
  `json_path` with the error (`complete` false, no plot) before the error goes on."""
  records = []
  value = parallelism = None
  try:
    for value, parallelism, c in points:
      logging.info("sweep %s=%s (%s)", kind, value, parallelism)
      records.append({"sweep_value": value, **one(c)})
  except (Exception, KeyboardInterrupt) as e:
    if json_path:
      _write_json(
        pathlib.Path(json_path),
        {
          "sweep": kind,
          "mode": mode,
          "config": records[0]["config"] if records else None,
          "plot": None,
          "complete": False,
          "error": f"{kind}={value} ({parallelism}): {type(e).__name__}: {e}",
          "points": records,
        },
      )
      logging.error(
        "--sweep=%s failed at %s=%s (%s); the %d point(s) done are in %s",
        kind,
        kind,
        value,
        parallelism,
        len(records),
        json_path,
      )
    raise
  return records


def run(config) -> None:
  from training.metrics import quiet_library_logs

  quiet_library_logs()
  if _PLOT_FROM.value:
    if not _PLOT.value:
      raise Stop("--plot_from needs --plot=<png>")
    plot_saved_sweeps(_PLOT_FROM.value, _PLOT.value)
    return
  if int(config.model.vocab_size) <= 0:
    logging.info("model.vocab_size is 0 (no vocabulary here): using %d", DEFAULT_VOCAB)
    config.model.vocab_size = DEFAULT_VOCAB
  mode, steps, warmup = _MODE.value, _STEPS.value, _WARMUP.value

  def one(c):
    if mode == "train":
      return bench_train(c, steps, warmup)
    return bench_decode(c, steps, warmup, _DECODE_CACHE.value)

  if _PAIRED.value:
    if not _FLAX_WMT.value:
      raise Stop("--paired times ours against flax examples/wmt: give --flax_wmt=<its directory>")
    if _SWEEP.value or _TRACE.value:
      raise Stop("--paired runs one benchmark without a trace: drop --sweep / --trace")
    if _SEPARATE.value:
      result = bench_paired_processes(sys.argv[1:], _FLAX_WMT.value, mode, steps, _ROUNDS.value)
    else:
      result = bench_paired(config, mode, steps, warmup, _ROUNDS.value)
    print_paired(result)
    if _JSON.value:
      _write_json(pathlib.Path(_JSON.value), result)
    return

  if _SEPARATE.value:
    raise Stop("--separate_processes is a way of running --paired: add --paired and --flax_wmt")
  if _SWEEP.value is None:
    if _SWEEP_VALUES.value or _PLOT.value:
      raise Stop("--sweep_values and --plot need --sweep")
    record = one(config)
    print_record(record)
    if _JSON.value:
      _write_json(pathlib.Path(_JSON.value), record)
    return

  kind = _SWEEP.value
  if kind == "devices" and mode != "train":
    raise Stop("--sweep=devices needs --mode=train (decoding runs on one device)")
  points = sweep_configs(config, kind, _SWEEP_VALUES.value, _SWEEP_PARALLELISM.value, mode)
  if not points:
    raise Stop(f"--sweep={kind}: no point to run")
  import jax

  if kind == "devices" and jax.default_backend() == "cpu":
    logging.warning(
      "simulated CPU devices share this host's %d cores: expect no speed-up, and "
      "an MFU that falls as devices are added",
      os.cpu_count() or 0,
    )
  records = run_points(points, one, kind, mode, _JSON.value)
  print_sweep(records, kind)
  plot = pathlib.Path(
    _PLOT.value
    or (pathlib.Path(_JSON.value).with_suffix(".png") if _JSON.value else f"bench_{kind}.png")
  )
  name = pathlib.Path(records[0]["config"] or "config").stem
  plot_sweep(
    records,
    kind,
    plot,
    f"{name}: {mode}, {records[0]['device_kind']}, {records[0]['dtype']}, "
    f"batch {config.bench.batch_size}, seq_len {config.bench.seq_len}"
    if kind == "devices"
    else f"{name}: {mode}, {records[0]['device_kind']}, {records[0]['dtype']}",
  )
  print(f"plot: {plot}")
  if _JSON.value:
    _write_json(
      pathlib.Path(_JSON.value),
      {
        "sweep": kind,
        "mode": mode,
        "config": records[0]["config"],
        "plot": str(plot),
        "complete": True,
        "points": records,
      },
    )


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    run(_CONFIG.value)
  except (Stop, ValueError) as e:
    if isinstance(e, ValueError) and os.environ.get("BENCH_DEBUG"):
      raise
    sys.stderr.write(f"bench.py: error: {e}\n")
    sys.exit(1)


if __name__ == "__main__":
  from configs.flags import parse

  app.run(main, flags_parser=parse)
