"""What bench.py is asked to time, as its flags say: the `Options` the benchmarks take (nothing in
benchmark/ reads flags), and the flag combinations that cannot run, refused before any work.
"""

from __future__ import annotations

import dataclasses

from benchmark import ctranslate2 as ct2
from benchmark.peak import AUTO, MATMUL_SIZE
from core.errors import UsageError
from inference import ctranslate2_export as export


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
    """From bench.py's flag values (`flags.FLAGS.flag_values_dict()`), after `check_flags`;
    `extra`: the fields that are not flags (config_path, host_memory)."""
    check_flags(values)
    fields = {f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values}
    if "ctranslate2_compute_types" in fields:  # absl gives a list
      fields["ctranslate2_compute_types"] = tuple(fields["ctranslate2_compute_types"])
    return cls(**fields, **extra)


def check_ctranslate2_flags(values: dict) -> None:
  """Refuses what --ctranslate2 cannot time (see `check_flags`)."""
  if values.get("flax_wmt"):
    raise UsageError("--flax_wmt and --ctranslate2 are two peers: time one at a time")
  if values.get("mode") != "decode":
    raise UsageError("--ctranslate2 times decoding: add --mode=decode")
  if values.get("sweep") or values.get("trace") or values.get("separate_processes"):
    raise UsageError(
      "--ctranslate2 runs one benchmark in this process without a trace: drop --sweep / "
      "--trace / --separate_processes"
    )
  if values.get("decode_cache") is False:
    raise UsageError("--ctranslate2 decodes with its cache: drop --decode_cache=false")
  types = values.get("ctranslate2_compute_types") or []
  unknown = [t for t in types if t not in export.COMPUTE_TYPES]
  if not types or unknown:
    raise UsageError(
      f"--ctranslate2_compute_types={','.join(types)}: expected some of "
      f"{', '.join(export.COMPUTE_TYPES)}"
    )


def check_flags(values: dict) -> None:
  """Refuses flags that do not go together (a UsageError naming them). `values`: the flags' values
  by name, as `flags.FLAGS.flag_values_dict()` gives them; a missing one is unset."""
  if values.get("ctranslate2"):
    check_ctranslate2_flags(values)
  if values.get("paired"):
    if not values.get("flax_wmt") and not values.get("ctranslate2"):
      raise UsageError(
        "--paired times ours against a peer: give --flax_wmt=<its directory> (flax "
        "examples/wmt) or --ctranslate2"
      )
    if values.get("sweep") or values.get("trace"):
      raise UsageError("--paired runs one benchmark without a trace: drop --sweep / --trace")
  elif values.get("separate_processes"):
    raise UsageError(
      "--separate_processes is a way of running --paired: add --paired and --flax_wmt"
    )
  elif values.get("sweep") is None and (values.get("sweep_values") or values.get("plot")):
    raise UsageError("--sweep_values and --plot need --sweep")
