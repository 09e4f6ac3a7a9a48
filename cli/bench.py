"""bench.py's command line: its flags, the combinations of them that cannot run (refused before any
work), and its main; the benchmarks themselves are benchmark/'s, which reads no flag.
"""

from __future__ import annotations

import sys

from absl import flags, logging
from ml_collections import config_flags

from benchmark import ctranslate2, paired, peak, report, sweeps, timing
from benchmark.options import Options
from cli import app
from cli.bench_processes import PARENT_ONLY_FLAGS, bench_paired_processes
from cli.files import check_writable
from cli.host_memory import DEFAULT
from core.errors import UsageError
from core.rules import Int
from inference.ctranslate2_translate import COMPUTE_TYPES

# The library's argument names (benchmark/sweeps.py) -> this command line's flags.
FLAG_NAMES = {
  "kind": "sweep",
  "values": "sweep_values",
  "modes": "sweep_parallelism",
  "paths": "plot_from",
  "wmt_dir": "flax_wmt",
  "path": "json",
}


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """This command line's flags, defined only when it runs (cli/app.py)."""
  app.define_config(flag_values)
  flags.adopt_module_key_flags(app, flag_values=flag_values)  # --config, --show_config in --help
  _define_run_flags(flag_values)
  _define_sweep_flags(flag_values)
  _define_measure_flags(flag_values)
  _define_peer_flags(flag_values)
  flags.mark_flag_as_required("config", flag_values=flag_values)
  for name, rule in (
    ("steps", Int(min=1)),
    ("warmup", Int(min=0)),
    ("matmul_size", Int(min=64)),
    ("rounds", Int(min=1)),
  ):
    app.check_flag(name, rule, flag_values)


def _define_run_flags(flag_values: flags.FlagValues) -> None:
  """What is timed, how long, and where the results go."""
  flags.DEFINE_enum("mode", "train", ["train", "decode"], "What to time.", flag_values=flag_values)
  flags.DEFINE_integer("steps", 20, "Timed steps (decode: timed batches).", flag_values=flag_values)
  flags.DEFINE_integer(
    "warmup", 3, "Untimed steps after the first (compiling) one.", flag_values=flag_values
  )
  flags.DEFINE_string("json", None, "Write the results to this JSON file.", flag_values=flag_values)


def _define_sweep_flags(flag_values: flags.FlagValues) -> None:
  """--sweep: the benchmark repeated over one setting, and its plot."""
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


def _define_measure_flags(flag_values: flags.FlagValues) -> None:
  """How ours is measured: the decoding cache, the peak FLOP/s, a profile."""
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


def _define_peer_flags(flag_values: flags.FlagValues) -> None:
  """The peers timed instead of ours, or beside it (--paired)."""
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


DEFAULT_VOCAB = 8000


def parent_only_booleans() -> set[str]:
  """Which of the flags a --separate_processes parent keeps to itself are boolean (they take no
  value: --name, --noname), as `define_flags` defines them."""
  defined = flags.FlagValues()
  define_flags(defined)
  return {name for name in PARENT_ONLY_FLAGS if defined[name].boolean}


def main(host_memory: str = DEFAULT) -> None:
  """bench.py's main: `host_memory` is what bench.py's start did (cli/host_memory.py)."""
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
  check_flags(values)
  options = Options.from_flags(
    values,
    config_path=config_flags.get_config_filename(f["config"]),
    host_memory=host_memory,
  )
  if f.paired:
    if f.separate_processes:
      result = bench_paired_processes(
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
  unknown = [t for t in types if t not in COMPUTE_TYPES]
  if not types or unknown:
    raise UsageError(
      f"--ctranslate2_compute_types={','.join(types)}: expected some of {', '.join(COMPUTE_TYPES)}"
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
