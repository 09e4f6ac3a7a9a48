"""What the host CPU offers: which computation dtype it multiplies fastest (`dtype='auto'` of
decoding, `inference.Translator.load` and decode.py's `--dtype`, and of training,
`model.dtype=auto`), and how many cores this process may run on (`usable_cores`: the batches a
CPU decodes at once by default).

    dtype, why = native_dtype("cpu")   # ('float32', 'this CPU has no native bfloat16 products ...')

bfloat16 halves the bytes a matrix product reads, but pays only where the hardware multiplies
bfloat16 itself: GPUs and TPUs, and x86 CPUs with AMX (`amx_bf16`, Sapphire Rapids and later) or
AVX512-BF16 (`avx512_bf16`: Cooper Lake, Sapphire Rapids, AMD Zen 4 and later). Elsewhere XLA:CPU
emulates the products by converting to float32 and back, slower than float32 itself (an AVX2-only
AMD EPYC Zen 3, issue #44; an Ice Lake Xeon, whose AVX-512 has no bfloat16 products, likewise), so
'auto' is float32 there, and on CPUs of other architectures (aarch64's `bf16` is not known to be
used by XLA:CPU's products).
"""

from __future__ import annotations

import functools
import os
import pathlib
from collections.abc import Collection

# The x86 CPU flags (Linux's /proc/cpuinfo names) of native bfloat16 products, best first.
BF16_FLAGS = {"amx_bf16": "AMX", "avx512_bf16": "AVX512-BF16"}
ACCELERATORS = ("gpu", "tpu", "cuda", "rocm")  # platforms whose matrix units multiply bfloat16


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
  """The host CPU's instruction-set flags (/proc/cpuinfo's `flags`, or `Features` on ARM); empty
  where there is no such file."""
  try:
    text = pathlib.Path("/proc/cpuinfo").read_text()
  except OSError:
    return frozenset()
  for line in text.splitlines():
    name, _, value = line.partition(":")
    if name.strip() in ("flags", "Features"):
      return frozenset(value.split())
  return frozenset()


def usable_cores() -> int:
  """The CPU cores this process may run on: its affinity mask (`taskset`, a container's cpuset),
  else the machine's count."""
  try:
    return max(1, len(os.sched_getaffinity(0)))
  except (AttributeError, OSError):
    return os.cpu_count() or 1


def native_dtype(platform: str, flags: Collection[str] | None = None) -> tuple[str, str]:
  """(dtype, why) for a device of `platform` ('cpu', 'gpu', 'tpu', ...): 'bfloat16' where its
  products are native, else 'float32'; `why` is a few words for the log. `flags`: the CPU's
  flags (default: this host's, `cpu_flags()`); only read for 'cpu'."""
  if platform in ACCELERATORS:
    return "bfloat16", f"auto: bfloat16 products are native on {platform.upper()}"
  if platform != "cpu":
    return "float32", f"auto: bfloat16 is not known to be native on platform {platform!r}"
  flags = cpu_flags() if flags is None else frozenset(flags)
  for flag, name in BF16_FLAGS.items():
    if flag in flags:
      return "bfloat16", f"auto: this CPU multiplies bfloat16 natively with {name}, flag {flag}"
  return "float32", f"auto: no {' or '.join(BF16_FLAGS)} flag, this CPU would emulate bfloat16"
