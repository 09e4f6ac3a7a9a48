"""Benchmarks the real train step (or decoding) on synthetic batches: step time, throughput, MFU.

    python bench.py --config=configs/wmt14_ende_base.py --json=base.json
    python bench.py --config=configs/tiny.py --config.model.vocab_size=8000 --mode=decode
    python bench.py --config=configs/tiny.py --config.model.vocab_size=8000 --sweep=devices \
        --json=devices.json   # also writes devices.png
    python bench.py --config=configs/bench_tiny.py --flax_wmt=flax-0.12.8/examples/wmt --paired
    python bench.py --config=configs/bench_tiny.py --mode=decode --ctranslate2 --paired

Batches are `bench.batch_size` × `bench.seq_len` random tokens; decoding always produces
`bench.decode_len` tokens (beam `bench.beam_size`). MFU is achieved model FLOP/s over the peak of
all devices (datasheet, else a measured matmul: `peak_source`). --flax_wmt=<dir> times google/flax
examples/wmt instead of ours; --ctranslate2 (--mode=decode) times CTranslate2 decoding our model's
own weights, at the first of --ctranslate2_compute_types; --paired times ours and the peer(s)
alternately (every compute type a peer; with flax's, --separate_processes runs each side in its
own process every round). The work is in benchmark/ (its modules' docstrings say how).
"""

from __future__ import annotations

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

from benchmark import ctranslate2, paired, peak, report, sweeps, timing  # noqa: E402
from benchmark.options import Options  # noqa: E402
from cli import app  # noqa: E402
from cli.files import check_writable  # noqa: E402
from configs.rules import Int, check_flag  # noqa: E402
from core.errors import UsageError  # noqa: E402


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """This command line's flags, defined only when it runs (cli/app.py)."""
  app.define_config(flag_values)
  flags.adopt_module_key_flags(app, flag_values=flag_values)  # --config, --show_config in --help
  flags.DEFINE_enum("mode", "train", ["train", "decode"], "What to time.", flag_values=flag_values)
  flags.DEFINE_integer("steps", 20, "Timed steps (decode: timed batches).", flag_values=flag_values)
  flags.DEFINE_integer(
    "warmup", 3, "Untimed steps after the first (compiling) one.", flag_values=flag_values
  )
  flags.DEFINE_string("json", None, "Write the results to this JSON file.", flag_values=flag_values)
  flags.DEFINE_enum(
    "sweep",
    None,
    ["devices", "seq_len", "batch"],
    "Repeat the benchmark over device counts (pmap and mesh), sequence "
    "lengths or batch sizes, and plot it.",
    flag_values=flag_values,
  )
  flags.DEFINE_list(
    "sweep_values",
    None,
    "The swept values (default: devices 1,2,4,8; seq_len "
    "16,32,64,128,256 up to model.max_len; batch 4,8,16,32).",
    flag_values=flag_values,
  )
  flags.DEFINE_list(
    "plot_from",
    None,
    "Plot these saved --sweep JSON files together into --plot (no "
    "benchmark runs), e.g. the seq_len sweeps of two model types.",
    flag_values=flag_values,
  )
  flags.DEFINE_list(
    "sweep_parallelism",
    ["pmap", "mesh"],
    "--sweep=devices: the parallelism modes to run.",
    flag_values=flag_values,
  )
  flags.DEFINE_string(
    "plot",
    None,
    "Sweep plot PNG (default: the --json path with .png, else bench_<sweep>.png).",
    flag_values=flag_values,
  )
  flags.DEFINE_bool(
    "decode_cache",
    True,
    "--mode=decode: use the key/value cache (false re-runs the "
    "whole decoder on the prefix every step).",
    flag_values=flag_values,
  )
  flags.DEFINE_string(
    "peak",
    peak.AUTO,
    "Peak FLOP/s per device: 'auto' (datasheet if the "
    "device and dtype are known, else measured), 'measured', or a number.",
    flag_values=flag_values,
  )
  flags.DEFINE_integer(
    "matmul_size",
    peak.MATMUL_SIZE,
    "Side of the square matrices of the measured peak.",
    flag_values=flag_values,
  )
  flags.DEFINE_string(
    "trace",
    None,
    "Write a jax.profiler trace of the timed steps to this "
    "directory (TensorBoard's profiler, or perfetto_trace.json.gz in "
    "ui.perfetto.dev).",
    flag_values=flag_values,
  )
  flags.DEFINE_string(
    "flax_wmt",
    None,
    "Time google/flax examples/wmt's own train step "
    "or beam search (its directory, e.g. from the flax sdist) on the "
    "same model shape and batch instead of ours (benchmark/flax_wmt.py).",
    flag_values=flag_values,
  )
  flags.DEFINE_bool(
    "ctranslate2",
    False,
    "--mode=decode: time CTranslate2's decoding (pip "
    "install ctranslate2) of this repository's model, its random weights "
    "exported, on the same batch and lengths, at the first of "
    "--ctranslate2_compute_types (with --paired: at each) instead of ours "
    "(benchmark/ctranslate2.py).",
    flag_values=flag_values,
  )
  flags.DEFINE_list(
    "ctranslate2_compute_types",
    list(ctranslate2.COMPUTE_TYPES),
    "--ctranslate2: the compute types CTranslate2 decodes in.",
    flag_values=flag_values,
  )
  flags.DEFINE_bool(
    "paired",
    False,
    "With --flax_wmt or --ctranslate2: time this repository's step (or "
    "decoding) and the peer's alternately in one process, --rounds rounds of "
    "--steps each, and report each and its speed ratio. All meet the "
    "machine's slow and fast moments alike, so the ratio is steadier than "
    "that of separate runs.",
    flag_values=flag_values,
  )
  flags.DEFINE_integer(
    "rounds",
    6,
    "--paired: rounds of --steps timed calls per implementation; the order swaps every round.",
    flag_values=flag_values,
  )
  flags.DEFINE_bool(
    "separate_processes",
    False,
    "With --paired: run each side in a "
    "fresh `python bench.py` process every round, each as it runs by "
    "itself: ours keeps freed host memory (cli/host_memory.py), "
    "flax's gets glibc's defaults, as its own main.py runs. Each round "
    "compiles again.",
    flag_values=flag_values,
  )
  flags.mark_flag_as_required("config", flag_values=flag_values)
  for name, rule in (
    ("steps", Int(min=1)),
    ("warmup", Int(min=0)),
    ("matmul_size", Int(min=64)),
    ("rounds", Int(min=1)),
  ):
    check_flag(name, rule, flag_values)


DEFAULT_VOCAB = 8000


def parent_only_booleans() -> set[str]:
  """Which of the flags a --separate_processes parent keeps to itself are boolean (they take no
  value: --name, --noname), as `define_flags` defines them."""
  defined = flags.FlagValues()
  define_flags(defined)
  return {name for name in paired.PARENT_ONLY_FLAGS if defined[name].boolean}


def main() -> None:
  f = flags.FLAGS
  check_writable(f.json, "--json")
  check_writable(f.plot, "--plot")
  if f.plot_from:
    if not f.plot:
      raise UsageError("--plot_from needs --plot=<png>")
    sweeps.plot_saved_sweeps(f.plot_from, f.plot)
    return
  config = app.load_config()
  if int(config.model.vocab_size) <= 0:
    logging.info("model.vocab_size is 0 (no vocabulary here): using %d", DEFAULT_VOCAB)
    config.model.vocab_size = DEFAULT_VOCAB
  values = f.flag_values_dict()
  options = Options.from_flags(
    values,
    config_path=config_flags.get_config_filename(f["config"]),
    host_memory=HOST_MEMORY,
  )
  if f.paired:
    if f.separate_processes:
      result = paired.bench_paired_processes(
        sys.argv[1:],
        parent_only_booleans(),
        f.flax_wmt,
        f.mode,
        f.steps,
        f.rounds,
      )
    else:
      result = paired.bench_paired(config, options, f.rounds)
    report.print_paired(result)
  elif f.sweep is None:
    result = timing.run_benchmark(config, options)
    report.print_record(result)
  else:
    sweeps.run_sweep(
      config,
      f.sweep,
      f.mode,
      lambda c: timing.run_benchmark(c, options),
      f.sweep_values,
      f.sweep_parallelism,
      f.json,
      f.plot,
    )
    return
  if f.json:
    report.write_json(f.json, result)


if __name__ == "__main__":
  define_flags()
  app.run(main, prog="bench.py")
