"""CTranslate2 at its best on this machine: times `python -m cli.ctranslate2_translate` on a file
under each GEMM path (its default, `CT2_USE_MKL=0` oneDNN, `CT2_USE_MKL=1` MKL) and each threading
(one replica on every core, or one replica per core with length groups in flight), whole
processes taking turns, and prints each configuration's backend line (`CT2_VERBOSE=1`) and
seconds, fastest first: the first line is the peer to compare against
(benchmark/ctranslate2.py).

    python -m cli.ctranslate2_peer --model=m30k_ct2 --input=test.en [--cores=2] [--runs=3] \
        [--pin=0] [--search_flags='--beam_size=5 --alpha=1.0']

`--search_flags` are cli.ctranslate2_translate's, as one string. Exit status 2: bad usage or
input; 1: a failure while running.
"""

from __future__ import annotations

import os
import shlex
import sys

from absl import flags

from benchmark.ctranslate2 import peer_configurations, time_peer
from cli import app
from core.errors import ArgumentError
from core.rules import Int


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """This command line's flags, defined only when it runs (cli/app.py)."""
  define = dict(flag_values=flag_values)
  flags.DEFINE_string("model", None, "Export directory.", required=True, **define)
  flags.DEFINE_string("input", None, "Source sentences, one per line.", required=True, **define)
  flags.DEFINE_integer("cores", 0, "Cores each configuration uses; 0 = all.", **define)
  flags.DEFINE_integer("runs", 3, "Timed runs of each configuration.", **define)
  flags.DEFINE_string("pin", None, "taskset CPU list each process is pinned to.", **define)
  flags.DEFINE_string(
    "search_flags", "", "cli.ctranslate2_translate's search flags, one string.", **define
  )
  app.check_flag("cores", Int(0), flag_values)
  app.check_flag("runs", Int(1), flag_values)


def main() -> None:
  f = flags.FLAGS
  if not os.path.isfile(f.input):
    raise ArgumentError("input", f.input, "no such file")
  cores = f.cores or os.cpu_count() or 1
  rows = time_peer(
    f.model, f.input, shlex.split(f.search_flags), peer_configurations(cores), f.runs, f.pin
  )
  if all("error" in row for row in rows):
    raise ArgumentError("search_flags", f.search_flags, f"no configuration ran: {rows[0]['error']}")
  for row in rows:
    if "error" in row:
      print(f"   fails  {row['configuration'].name():36s} [{row['backend']}]  {row['error']}")
      continue
    seconds = " ".join(f"{s:.2f}" for s in row["seconds"])
    print(
      f"{row['median']:7.2f} s  {row['configuration'].name():36s} "
      f"[{row['backend'] or 'no backend line'}]  runs: {seconds}"
    )
  sys.stdout.flush()


if __name__ == "__main__":
  define_flags()
  app.run(main, prog="cli.ctranslate2_peer")
