"""This repository against its peers, timed alternately so that all meet the machine's slow and
fast moments alike: against google/flax examples/wmt or CTranslate2 (at one or more compute types)
in one process (`bench_paired`, rounds of steps of each runner). With each side in its own fresh
`python bench.py` process every round, the rounds are bench.py's command line's to run
(cli/bench_processes.py), in the order `round_order` gives.
"""

from __future__ import annotations

import jax
import numpy as np

from benchmark.options import Options
from benchmark.peak import resolve_peak
from benchmark.records import Runner, first_and_warmup, time_calls
from benchmark.timing import check_config, make_runners

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


def round_order(i: int, sides: int = 2) -> tuple[int, ...]:
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
    for j in round_order(i, len(runners)):
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
