"""bench.py --paired --separate_processes: this repository against flax examples/wmt, each side in
its own fresh `python bench.py` process every round, each with its own out-of-the-box host-memory
setting (ours keeps freed memory as bench.py sets it, flax's gets glibc's defaults, as its own
main.py runs): the children's command lines are built from the parent's.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
from collections.abc import Collection

import numpy as np
from absl import logging

from benchmark import report
from benchmark.paired import round_order
from cli.host_memory import user_settings
from core.errors import RunError

# The command line every child runs.
BENCH_SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "bench.py"

# Flags the parent keeps to itself; each child gets the rest of its command line, its own --json
# and, on flax's side, --flax_wmt.
PARENT_ONLY_FLAGS = ("paired", "separate_processes", "rounds", "json", "flax_wmt")


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
    for j in round_order(i):
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
