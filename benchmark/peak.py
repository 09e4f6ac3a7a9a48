"""What a device can do and what a run used of it: peak FLOP/s (datasheet, measured or given), the
MFU fields of a train record (`utilization`) and the device's peak memory.

MFU = achieved model FLOP/s / (peak FLOP/s per device × devices), with the model FLOPs of
training/flops.py and the device's datasheet peak for the dtype, or, for a device not in the
table, the best rate of a large matrix product measured on one device, sampled before and after
the timed steps (`peak_source` says which; `peak_samples_flops_per_s` has the samples). In the
record, `achieved_flops_per_s` is the total over all devices, `peak_flops_per_s` is per device and
`peak_flops_per_s_total` is that × num_devices, so mfu = achieved / peak total.
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from core.errors import ArgumentError
from training import flops

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

# bench.py's --peak and --matmul_size defaults.
AUTO = "auto"
MATMUL_SIZE = 2048

# Measured peaks of this process by (device kind, dtype, matmul size): PEAK_SAMPLES samples, one
# before the first run's timed steps and one after them, and the peak is the highest. On a
# shared or throttled machine a sample can catch a few seconds at half speed (seen on the 2-core
# VM: 105 against 200 GFLOP/s); two samples far apart in time rarely both do. Every later point
# of a sweep is divided by the same yardstick, and the matmul's buffers raise the allocator's
# peak (which never resets) before the first point reads its own.
PEAK_SAMPLES = 2
_MEASURED_PEAKS: dict[tuple[str, str, int], list[float]] = {}


def datasheet_peak(device_kind: str, dtype: str) -> float | None:
  """The datasheet dense peak FLOP/s of one device for `dtype`, or None if not in the table."""
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


def resolve_peak(
  device, dtype: str, peak: str = AUTO, matmul_size: int = MATMUL_SIZE
) -> tuple[float, str]:
  """(peak FLOP/s of one device, 'datasheet' | 'measured' | 'given') as `peak` (--peak) asks:
  'auto' (the datasheet's when the device and dtype are known, else measured), 'measured' (the
  best of PEAK_SAMPLES products of `matmul_size`-wide matrices), or a number."""
  choice = peak.strip().lower()
  if choice not in ("auto", "measured"):
    try:
      given = float(choice)
    except ValueError:
      given = math.nan
    if not (math.isfinite(given) and given > 0):
      raise ArgumentError(
        "peak", peak, "expected auto, measured or a positive number of FLOP/s per device"
      )
    return given, "given"
  if choice == "auto":
    known = datasheet_peak(device.device_kind, dtype)
    if known is not None:
      return known, "datasheet"
  samples = _MEASURED_PEAKS.setdefault((device.device_kind, dtype, matmul_size), [])
  if len(samples) < PEAK_SAMPLES:
    samples.append(measured_peak(device, dtype, matmul_size))
    logging.info(
      "measured peak of %s (%s, %d-wide matmul), sample %d: %.3g FLOP/s",
      device.device_kind,
      dtype,
      matmul_size,
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


def peak_samples(device, dtype: str, matmul_size: int = MATMUL_SIZE) -> list[float] | None:
  """The measured peak's samples (FLOP/s) for `device` and `dtype`, or None if not measured."""
  return _MEASURED_PEAKS.get((device.device_kind, dtype, matmul_size))


def utilization(
  config,
  devices,
  step_time_s: float,
  memory_before: int | None,
  peak: str = AUTO,
  matmul_size: int = MATMUL_SIZE,
) -> dict:
  """The train record's memory and FLOP fields for a [bench.batch_size, bench.seq_len] step of
  `step_time_s` on `devices`: peak_memory_bytes, model_flops_per_step, achieved_flops_per_s (all
  devices), peak_flops_per_s (one device, `resolve_peak(..., peak, matmul_size)`),
  peak_flops_per_s_total (× devices), peak_source and mfu = achieved / peak total."""
  # Read first: resolving the peak may run the measured matmul, which would be counted otherwise.
  memory = own_peak_memory(memory_before)
  rows, length = int(config.bench.batch_size), int(config.bench.seq_len)
  try:
    model_flops = flops.train_flops(config.model, rows, length, length)
  except ValueError as e:
    logging.warning("%s: no MFU", e)
    model_flops = None
  per_device, source = resolve_peak(devices[0], config.model.dtype, peak, matmul_size)
  samples = (
    peak_samples(devices[0], config.model.dtype, matmul_size) if source == "measured" else None
  )
  peak_total = per_device * len(devices)
  achieved = None if model_flops is None else model_flops / step_time_s
  mfu = None if achieved is None else achieved / peak_total
  if mfu is not None and mfu > 1:
    logging.warning(
      "MFU %.2f > 1: the %s peak %.3g FLOP/s is too low for this device and dtype "
      "(float32 may run as TF32); try --peak=measured",
      mfu,
      source,
      per_device,
    )
  return {
    "model_flops_per_step": model_flops,
    "achieved_flops_per_s": achieved,
    "peak_flops_per_s": per_device,
    "peak_flops_per_s_total": peak_total,
    "peak_source": source,
    "peak_samples_flops_per_s": None if samples is None else list(samples),
    "mfu": mfu,
    "peak_memory_bytes": memory,
  }


def own_peak_memory(before: int | None) -> int | None:
  """This run's peak device memory: the allocator's peak counts from the start of the process and
  never resets, so it is this run's own only if the run raised it above `before` (the value read
  when the run started). None when the backend reports nothing or an earlier run (a previous
  sweep point) peaked higher. Reads all local devices, as `before` should."""
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
