"""What bench.py is asked to time, as its flags say: the `Options` the benchmarks take (nothing in
benchmark/ reads flags; the flags and their combinations are cli/bench.py's).
"""

from __future__ import annotations

import dataclasses

from benchmark import ctranslate2 as ct2
from benchmark.peak import AUTO, MATMUL_SIZE


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
  ctranslate2: bool = False  # time CTranslate2's decoding of our model [--ctranslate2]
  # its compute types: each a peer with --paired, the first alone [--ctranslate2_compute_types]
  ctranslate2_compute_types: tuple[str, ...] = ct2.COMPUTE_TYPES
  config_path: str | None = None  # the config file, as the record names it [--config]
  host_memory: str = "process default"  # cli/host_memory.py's setting, as records report it

  @classmethod
  def from_flags(cls, values: dict, **extra) -> Options:
    """From bench.py's flag values (`flags.FLAGS.flag_values_dict()`), checked together by its
    command line (cli/bench.py); `extra`: the fields that are not flags (config_path,
    host_memory)."""
    fields = {f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values}
    if "ctranslate2_compute_types" in fields:  # absl gives a list
      fields["ctranslate2_compute_types"] = tuple(fields["ctranslate2_compute_types"])
    return cls(**fields, **extra)
