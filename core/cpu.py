"""What the host CPU offers: which computation dtype it multiplies fastest (`dtype='auto'` of
decoding, `inference.Translator.load` and decode.py's `--dtype`, and of training,
`model.dtype=auto`), and how many cores this process may run on (`usable_cores`: the batches a
CPU decodes at once by default).

    dtype, why = native_dtype("cpu")   # ('float32', 'auto: no amx_bf16 or avx512_bf16 flag, ...')

bfloat16 halves the bytes a matrix product reads, but pays only where the hardware multiplies
bfloat16 faster than float32: GPUs and TPUs, x86 CPUs with AMX (`amx_bf16`, Sapphire Rapids and
later), and AMD CPUs with AVX512-BF16 (`avx512_bf16`, Zen 4 and later), whose bfloat16 dot products
do twice the multiply-adds of their float32 ones. An Intel core with AVX512-BF16 but no AMX
(Cooper Lake, or a Sapphire or Emerald Rapids whose hypervisor hides AMX) has two float32 FMA
units against one for bfloat16 pairs: no faster, and its conversions make decoding and training
slower than float32 (docs/experiments.md). Elsewhere XLA:CPU emulates the products by converting
to float32 and back, slower than float32 itself (an AVX2-only AMD EPYC Zen 3, issue #44; an Ice
Lake Xeon, whose AVX-512 has no bfloat16 products, likewise), so 'auto' is float32 there, and on
CPUs of other architectures (aarch64's `bf16` is not known to be used by XLA:CPU's products).
"""

from __future__ import annotations

import functools
import os
import pathlib
from collections.abc import Collection

# The x86 CPU flags (Linux's /proc/cpuinfo names) of native bfloat16 products, best first, and
# the vendors (`vendor_id`) whose products they make faster than float32's (None: any).
BF16_FLAGS = {"amx_bf16": ("AMX", None), "avx512_bf16": ("AVX512-BF16", "AuthenticAMD")}
ACCELERATORS = ("gpu", "tpu", "cuda", "rocm")  # platforms whose matrix units multiply bfloat16


@functools.lru_cache(maxsize=1)
def cpuinfo() -> dict[str, str]:
  """The first processor's fields of /proc/cpuinfo (name -> value: 'model name', 'vendor_id',
  'flags', ...); empty where there is no such file."""
  try:
    text = pathlib.Path("/proc/cpuinfo").read_text()
  except OSError:
    return {}
  fields: dict[str, str] = {}
  for line in text.splitlines():
    if not line.strip():
      break
    name, _, value = line.partition(":")
    fields.setdefault(name.strip(), value.strip())
  return fields


def cpu_flags() -> frozenset[str]:
  """The host CPU's instruction-set flags (/proc/cpuinfo's `flags`, or `Features` on ARM); empty
  where there is no such file."""
  info = cpuinfo()
  return frozenset((info.get("flags") or info.get("Features") or "").split())


def cpu_vendor() -> str:
  """The host CPU's vendor (/proc/cpuinfo's `vendor_id`: 'GenuineIntel', 'AuthenticAMD'); '' where
  it does not say."""
  return cpuinfo().get("vendor_id", "")


def usable_cores() -> int:
  """The CPU cores this process may run on: its affinity mask (`taskset`, a container's cpuset),
  else the machine's count."""
  try:
    return max(1, len(os.sched_getaffinity(0)))
  except (AttributeError, OSError):
    return os.cpu_count() or 1


# VNNI's byte products (unsigned by signed, summed in int32), which model/quantize.py's uint8
# form reaches; an AMX CPU's int8 × int8 products run on AMX already (docs/experiments.md).
VNNI_FLAGS = ("avx512_vnni", "avx_vnni")


def uint8_int8_products(platform: str, flags: Collection[str] | None = None) -> bool:
  """Whether int8 decoding on a device of `platform` takes its products' inputs as uint8: on a
  CPU with VNNI and no AMX. `flags`: the CPU's (default: this host's, `cpu_flags()`)."""
  if platform != "cpu":
    return False
  flags = cpu_flags() if flags is None else frozenset(flags)
  return any(f in flags for f in VNNI_FLAGS) and "amx_int8" not in flags


def native_dtype(
  platform: str, flags: Collection[str] | None = None, vendor: str | None = None
) -> tuple[str, str]:
  """(dtype, why) for a device of `platform` ('cpu', 'gpu', 'tpu', ...): 'bfloat16' where its
  products are native and faster than float32's, else 'float32'; `why` is a few words for the
  log. `flags` and `vendor`: the CPU's flags and vendor (default: this host's, `cpu_flags()` and
  `cpu_vendor()`); only read for 'cpu'."""
  if platform in ACCELERATORS:
    return "bfloat16", f"auto: bfloat16 products are native on {platform.upper()}"
  if platform != "cpu":
    return "float32", f"auto: bfloat16 is not known to be native on platform {platform!r}"
  flags = cpu_flags() if flags is None else frozenset(flags)
  vendor = cpu_vendor() if vendor is None else vendor
  for i, (flag, (name, maker)) in enumerate(BF16_FLAGS.items()):
    if flag not in flags:
      continue
    if maker in (None, vendor):
      return "bfloat16", f"auto: this CPU multiplies bfloat16 natively with {name}, flag {flag}"
    better = " or ".join(n for n, _ in list(BF16_FLAGS.values())[:i])  # flags before it: absent
    return "float32", (
      f"auto: this CPU ({vendor or 'vendor unknown'}) has {flag} but no {better}: its bfloat16 "
      "products are no faster than float32's"
    )
  return "float32", f"auto: no {' or '.join(BF16_FLAGS)} flag, this CPU would emulate bfloat16"
