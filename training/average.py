"""Checkpoint averaging (the paper evaluates the mean of the last 5 base / 20 big checkpoints).

    python -m training.average --workdir=runs/base --last=5
    python decode.py --workdir=runs/base --checkpoint=average:5 ...

Writes `<workdir>/averaged/last<k>`, which decode.py loads for `--checkpoint=average:<k>`.
"""

from __future__ import annotations

import sys

from absl import app, flags

_WORKDIR = flags.DEFINE_string("workdir", None, "Training workdir.", required=True)
_LAST = flags.DEFINE_integer("last", 5, "Average the last N checkpoints.", lower_bound=1)


def main(argv):
  del argv
  from training.checkpoint import write_average

  try:
    out = write_average(_WORKDIR.value, _LAST.value)
  except (ValueError, FileNotFoundError) as e:
    sys.stderr.write(f"training.average: error: {e}\n")
    sys.exit(2)
  print(f"averaged the last {_LAST.value} checkpoints into {out}")


if __name__ == "__main__":
  app.run(main)
