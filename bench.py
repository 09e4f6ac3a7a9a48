"""Benchmarks the real train step (or decoding) on synthetic batches: step time, throughput, MFU.

    python bench.py --config=configs/wmt14_ende_base.py --json=base.json
    python bench.py --config=configs/tiny.py --config.model.vocab_size=8000 --mode=decode
    python bench.py --config=configs/tiny.py --config.model.vocab_size=8000 --sweep=devices \
        --json=devices.json   # also writes devices.png
    python bench.py --config=configs/bench_tiny.py --flax_wmt=flax-0.12.8/examples/wmt --paired

Batches are `bench.batch_size` × `bench.seq_len` random tokens; decoding always produces
`bench.decode_len` tokens (beam `bench.beam_size`). MFU is achieved model FLOP/s over the peak of
all devices (datasheet, else a measured matmul: `peak_source`). --flax_wmt=<dir> times google/flax
examples/wmt instead of ours; --paired times both alternately (--separate_processes: each in its
own process every round). The work is in benchmark/ (its modules' docstrings say how).
"""

from __future__ import annotations

import dataclasses
import os
import sys

from cli.host_memory import DEFAULT, keep_freed_memory_on_cpu


def _simulate_cpu_devices(argv: list[str]) -> None:
  """--sweep=devices on a CPU needs several devices; XLA makes them only if told before JAX is
  imported. (The flag changes nothing on GPUs and TPUs.)"""
  wants = "--sweep=devices" in argv or any(
    a == "--sweep" and b == "devices" for a, b in zip(argv, argv[1:])
  )
  flag = "--xla_force_host_platform_device_count"
  if wants and flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {flag}=8").strip()


# Whether this process keeps freed host memory (cli/host_memory.py; reported as `host_memory`):
# run as a script on the CPU it does, set before JAX starts its threads.
HOST_MEMORY = DEFAULT
if __name__ == "__main__":
  _simulate_cpu_devices(sys.argv)
  HOST_MEMORY = keep_freed_memory_on_cpu()

from absl import flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from benchmark import paired, peak, report, sweeps, timing  # noqa: E402
from cli import app  # noqa: E402
from cli.errors import UsageError  # noqa: E402

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
  peak.AUTO,
  "Peak FLOP/s per device: 'auto' (datasheet if the "
  "device and dtype are known, else measured), 'measured', or a number.",
)
_MATMUL_SIZE = flags.DEFINE_integer(
  "matmul_size",
  peak.MATMUL_SIZE,
  "Side of the square matrices of the measured peak.",
  lower_bound=64,
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
  "same model shape and batch instead of ours (benchmark/flax_wmt.py).",
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
  "itself: ours keeps freed host memory (cli/host_memory.py), "
  "flax's gets glibc's defaults, as its own main.py runs. Each round "
  "compiles again.",
)
flags.mark_flag_as_required("config")

DEFAULT_VOCAB = 8000


def parent_only_booleans() -> set[str]:
  """Which of the flags a --separate_processes parent keeps to itself are boolean (they take no
  value: --name, --noname), as defined above."""
  return {name for name in paired.PARENT_ONLY_FLAGS if flags.FLAGS[name].boolean}


def check_flags(values: dict) -> None:
  """Refuses flags that do not go together (a UsageError naming them). `values`: the flags' values
  by name, as `flags.FLAGS.flag_values_dict()` gives them; a missing one is unset."""
  if values.get("paired"):
    if not values.get("flax_wmt"):
      raise UsageError(
        "--paired times ours against flax examples/wmt: give --flax_wmt=<its directory>"
      )
    if values.get("sweep") or values.get("trace"):
      raise UsageError("--paired runs one benchmark without a trace: drop --sweep / --trace")
  elif values.get("separate_processes"):
    raise UsageError(
      "--separate_processes is a way of running --paired: add --paired and --flax_wmt"
    )
  elif values.get("sweep") is None and (values.get("sweep_values") or values.get("plot")):
    raise UsageError("--sweep_values and --plot need --sweep")


def main() -> None:
  if _PLOT_FROM.value:
    if not _PLOT.value:
      raise UsageError("--plot_from needs --plot=<png>")
    sweeps.plot_saved_sweeps(_PLOT_FROM.value, _PLOT.value)
    return
  config = _CONFIG.value
  if int(config.model.vocab_size) <= 0:
    logging.info("model.vocab_size is 0 (no vocabulary here): using %d", DEFAULT_VOCAB)
    config.model.vocab_size = DEFAULT_VOCAB
  values = flags.FLAGS.flag_values_dict()
  check_flags(values)
  options = timing.Options(  # its fields are named after the flags, but for these two
    **{f.name: values[f.name] for f in dataclasses.fields(timing.Options) if f.name in values},
    config_path=config_flags.get_config_filename(flags.FLAGS["config"]),
    host_memory=HOST_MEMORY,
  )
  if _PAIRED.value:
    if _SEPARATE.value:
      result = paired.bench_paired_processes(
        sys.argv[1:],
        parent_only_booleans(),
        _FLAX_WMT.value,
        _MODE.value,
        _STEPS.value,
        _ROUNDS.value,
      )
    else:
      result = paired.bench_paired(config, options, _ROUNDS.value)
    report.print_paired(result)
  elif _SWEEP.value is None:
    result = timing.run_benchmark(config, options)
    report.print_record(result)
  else:
    sweeps.run_sweep(
      config,
      _SWEEP.value,
      _MODE.value,
      lambda c: timing.run_benchmark(c, options),
      _SWEEP_VALUES.value,
      _SWEEP_PARALLELISM.value,
      _JSON.value,
      _PLOT.value,
    )
    return
  if _JSON.value:
    report.write_json(_JSON.value, result)


if __name__ == "__main__":
  app.run(main, prog="bench.py")
