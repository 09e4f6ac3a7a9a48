"""The dtype 'auto' resolves to (core/cpu.py): bfloat16 where the products are native and faster
than float32's (GPUs, TPUs, x86 CPUs with AMX, AMD CPUs with AVX512-BF16), float32 elsewhere, for
given CPU flag sets and vendors; and where int8 products take uint8 inputs (VNNI, no AMX)."""

import pytest

from core.cpu import cpu_flags, cpu_vendor, native_dtype, uint8_int8_products

AVX2 = {"sse4_2", "avx", "avx2", "fma", "f16c"}  # e.g. AMD EPYC Zen 3
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}  # e.g. Ice Lake
AMX = {"avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}
AMD, INTEL = "AuthenticAMD", "GenuineIntel"


@pytest.mark.parametrize(
  "flags, vendor, dtype, named",
  [
    (AVX2, AMD, "float32", "would emulate bfloat16"),
    (AVX512, INTEL, "float32", "would emulate bfloat16"),
    (AVX512 | {"avx512_bf16"}, AMD, "bfloat16", "with AVX512-BF16, flag avx512_bf16"),  # Zen 4
    # Cooper Lake; a Sapphire or Emerald Rapids with AMX hidden: one bfloat16 unit, two float32's
    (AVX512 | {"avx512_bf16"}, INTEL, "float32", "(GenuineIntel) has avx512_bf16 but no AMX"),
    (AVX512 | {"avx512_bf16"}, "", "float32", "(vendor unknown) has avx512_bf16 but no AMX"),
    (AVX512 | AMX, INTEL, "bfloat16", "with AMX, flag amx_bf16"),
    (AVX512 | AMX, AMD, "bfloat16", "with AMX, flag amx_bf16"),
    ({"fp", "asimd", "bf16", "sve"}, "", "float32", "would emulate bfloat16"),  # aarch64
    (set(), "", "float32", "would emulate bfloat16"),  # no /proc/cpuinfo
  ],
)
def test_cpus_get_bfloat16_only_where_its_products_are_faster(flags, vendor, dtype, named):
  got, why = native_dtype("cpu", flags, vendor)
  assert got == dtype and why.startswith("auto: ") and named in why, why


@pytest.mark.parametrize(
  "flags, uint8",
  [
    (AVX2, False),  # Zen 3: no VNNI
    (AVX512, True),  # Ice Lake, Zen 4: avx512_vnni
    (AVX2 | {"avx_vnni"}, True),  # Alder Lake's AVX-VNNI
    (AVX512 | AMX, False),  # AMX multiplies int8 by int8 itself
    (set(), False),
  ],
)
def test_int8_products_take_uint8_inputs_where_vnni_multiplies_them(flags, uint8):
  assert uint8_int8_products("cpu", flags) is uint8
  assert uint8_int8_products("gpu", flags) is False
  assert uint8_int8_products("cpu") is uint8_int8_products("cpu", cpu_flags())


def test_accelerators_get_bfloat16_and_other_platforms_float32():
  for platform in ("gpu", "tpu", "cuda", "rocm"):
    dtype, why = native_dtype(platform, AVX2)  # the host's flags do not matter
    assert dtype == "bfloat16" and "native" in why
  assert native_dtype("metal", {"amx_bf16"})[0] == "float32"


def test_this_hosts_flags_and_vendor_decide_by_default():
  assert native_dtype("cpu") == native_dtype("cpu", cpu_flags(), cpu_vendor())


def test_training_resolves_model_dtype_auto_by_the_backend():
  """model.dtype=auto passes the config's checks and becomes, in the config (as checkpoints
  record it), the backend's choice."""
  import jax

  from tests.helpers import tiny_config
  from training.validate import check_backend, check_config

  config = tiny_config(num_devices=1, **{"model.dtype": "auto"})
  check_config(config, "train")
  check_backend(config)
  assert config.model.dtype == native_dtype(jax.default_backend())[0]


@pytest.mark.parametrize(
  "text, flags, vendor",
  [
    (
      "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 avx512_bf16\n\n"
      "processor\t: 1\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu\n",
      {"fpu", "avx2", "avx512_bf16"},
      "AuthenticAMD",
    ),
    ("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd bf16\n", {"fp", "asimd", "bf16"}, ""),
    (None, set(), ""),  # no /proc/cpuinfo
  ],
)
def test_flags_and_vendor_are_the_first_processors(monkeypatch, text, flags, vendor):
  import pathlib

  from core import cpu

  def read_text(self, *args, **kwargs):
    if text is None:
      raise FileNotFoundError(self)
    return text

  monkeypatch.setattr(pathlib.Path, "read_text", read_text)
  cpu.cpuinfo.cache_clear()
  try:
    assert cpu.cpu_flags() == flags and cpu.cpu_vendor() == vendor
  finally:
    monkeypatch.undo()
    cpu.cpuinfo.cache_clear()
