"""This repository against its peers, timed alternately so that all meet the machine's slow and
fast moments alike: against google/flax examples/wmt or CTranslate2 (at one or more compute types)
in one process (`bench_paired`, rounds of steps of each runner), or against flax's with each side
in its own fresh `python bench.py` process every round
(`bench_paired_processes`, each with its own out-of-the-box host-memory setting: ours keeps freed
memory as bench.py sets it, flax's gets glibc's defaults, as its own main.py runs).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
from collections.abc import Collection

import jax
import numpy as np
from absl import logging

from benchmark import report
from benchmark.options import Options
from benchmark.peak import resolve_peak
from benchmark.records import Runner, first_and_warmup, time_calls
from benchmark.timing import check_config, make_runners
from cli.host_memory import user_settings
from core.errors import RunError

# The command line every child of --separate_processes runs.
BENCH_SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "bench.py"

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

# Flags the parent of --separate_processes keeps to itself; each child gets the rest of its
# command line, its own --json and, on flax's side, --flax_wmt.
PARENT_ONLY_FLAGS = ("paired", "separate_processes", "rounds", "json", "flax_wmt")


def _round_order(i: int, sides: int = 2) -> tuple[int, ...]:
  """The order of the sides in round `i` of a paired benchmark: ours (0) first in even rounds,
  last in odd ones (0 1 2, 2 1 0, ...)."""
  order = tuple(range(sides))
  return order if i % 2 == 0 else order[::-1]


def time_paired(runners: list[Runner], steps: int, warmup: int, rounds: int):
  """Times runners (ours first, then its peers) alternately: each one's first (compiling) call
  and `warmup` calls, then `rounds` rounds of `steps` timed calls of each, in order in even rounds
  and in reverse in odd ones (A B C, C B A, ...), so a slow spell of the machine or a drift over
  the run falls on all alike.

  Returns (first call seconds per runner, timed seconds per runner, for each peer its per-round
  ratios of its median step to the first runner's: above 1 when the first is faster)."""
  firsts = [first_and_warmup(r.call, warmup) for r in runners]
  times: list[list[float]] = [[] for _ in runners]
  ratios: list[list[float]] = [[] for _ in runners[1:]]
  for i in range(rounds):
    this_round = {}
    for j in _round_order(i, len(runners)):
      this_round[j] = time_calls(runners[j].call, steps)
      times[j] += this_round[j]
    for j, peer in enumerate(ratios, start=1):
      peer.append(float(np.median(this_round[j]) / np.median(this_round[0])))
  return firsts, [np.asarray(t) for t in times], ratios


def _speedup(ours: dict, peer: dict, ratios: list[float]) -> dict:
  """The speed-up fields of one peer: its median step time over ours, and over the rounds."""
  return {
    "speedup": peer["step_time_s"] / ours["step_time_s"],
    "speedup_min": min(ratios),
    "speedup_max": max(ratios),
    "speedup_per_round": ratios,
  }


def bench_paired(config, options: Options, rounds: int, make=make_runners) -> dict:
  """This repository against its peers in one process (`time_paired`, `options.steps` per
  round): flax examples/wmt (`options.flax_wmt`), or CTranslate2 at each of
  `options.ctranslate2_compute_types` (`options.ctranslate2`). `make(config, options)` builds the
  runners, ours first (default: timing.make_runners, those of `options.mode`).

  Returns PAIRED_FIELDS: `speedup` = the first peer's median step time / ours over all rounds (=
  our tokens/s or sentences/s over its: same batch), its range over the rounds, and every record
  (whose peak_memory_bytes is null: the sides share the process, and its allocator's peak). With
  more than one peer, `peer_speedups` holds each peer's `implementation` and speed-up fields."""
  mode = options.mode
  check_config(config, mode)
  if mode == "train":  # the measured peak's first sample, before the timed steps
    resolve_peak(jax.local_devices()[0], config.model.dtype, options.peak, options.matmul_size)
  runners = make(config, options)
  firsts, times, ratios = time_paired(runners, options.steps, options.warmup, rounds)
  records = [
    dict(r.record(first, t), peak_memory_bytes=None) for r, first, t in zip(runners, firsts, times)
  ]
  result = {
    "mode": mode,
    "paired": True,
    "separate_processes": False,
    "rounds": rounds,
    "steps_per_round": options.steps,
    **_speedup(records[0], records[1], ratios[0]),
    "records": records,
  }
  if len(records) > 2:
    result["peer_speedups"] = [
      {"implementation": peer["implementation"], **_speedup(records[0], peer, r)}
      for peer, r in zip(records[1:], ratios)
    ]
  return result


def child_argv(argv: list[str], booleans: Collection[str]) -> list[str]:
  """`argv` (flags only, no program name) without PARENT_ONLY_FLAGS, in any of absl's forms:
  --name=value, --name value, and for a boolean --name (one of `booleans`, as bench.py's flags
  define them), --noname."""
  out, i = [], 0
  while i < len(argv):
    arg = argv[i]
    name = arg.lstrip("-").split("=", 1)[0] if arg.startswith("-") else None
    if name and name.startswith("no") and name[2:] in PARENT_ONLY_FLAGS:
      name = name[2:]
    if name in PARENT_ONLY_FLAGS:
      i += 2 if name not in booleans and "=" not in arg else 1
      continue
    out.append(arg)
    i += 1
  return out


def flax_environment(environ=os.environ) -> dict:
  """The environment of flax's process under --separate_processes: glibc's default malloc, as
  flax examples/wmt's main.py runs. MALLOC_ARENA_MAX at glibc's own default for 64-bit hosts (8
  per core) changes nothing in glibc but makes cli/host_memory.py stand aside. When the
  environment has its own malloc settings, both sides keep those."""
  env = dict(environ)
  if not user_settings(env):
    env["MALLOC_ARENA_MAX"] = str(8 * (os.cpu_count() or 1))
  return env


def run_child(argv: list[str], env: dict) -> dict:
  """Runs `python bench.py <argv>` with --json to a temporary file; returns its record. A
  failed run is a RunError with the end of its stderr."""
  with tempfile.TemporaryDirectory() as tmp:
    path = pathlib.Path(tmp) / "record.json"
    command = [sys.executable, str(BENCH_SCRIPT), *argv, f"--json={path}"]
    logging.info("running %s", " ".join(command))
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0 or not path.exists():
      tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
      raise RunError(
        f"--separate_processes: `{' '.join(command)}` failed (exit status "
        f"{done.returncode}):\n{tail}"
      )
    return json.loads(path.read_text())


def bench_paired_processes(
  argv: list[str],
  booleans: Collection[str],
  flax_wmt: str,
  mode: str,
  steps: int,
  rounds: int,
  run=run_child,
) -> dict:
  """This repository against flax examples/wmt, each side in its own process every round (ours
  first in even rounds, flax's first in odd ones), each with its own host-memory setting:
  ours as bench.py sets it, flax's with glibc's defaults (`flax_environment`). `argv`: this
  command line's flags, `booleans` its boolean flags' names (for `child_argv`); `steps`: its
  --steps, each child's timed steps; `run(argv, env)` runs one child and returns its record.

  Returns PAIRED_FIELDS, `separate_processes` true, and `round_records` (each side's record of
  every round): `speedup` = flax's median step time over the rounds / ours, `records` each
  side's record of its median round (the lower middle one for an even count)."""
  base = child_argv(argv, booleans)
  sides = [(base, dict(os.environ)), (base + [f"--flax_wmt={flax_wmt}"], flax_environment())]
  round_records: list[list[dict]] = [[], []]
  for i in range(rounds):
    for j in _round_order(i):
      record = run(*sides[j])
      round_records[j].append(record)
      report.print_round(i, rounds, record)
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
