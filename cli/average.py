"""The command line of checkpoint averaging (training/average.py):

    python -m cli.average --workdir=runs/base --last=5

writes `<workdir>/averaged/last<k>`, the mean of the last k checkpoints' parameters, which
`decode.py --checkpoint=average:<k>` loads.
"""

from __future__ import annotations

from absl import flags

from cli import app
from core.rules import Int
from training.average import write_average


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """This command line's flags, defined only when it runs (cli/app.py)."""
  flags.DEFINE_string("workdir", None, "Training workdir.", required=True, flag_values=flag_values)
  flags.DEFINE_integer("last", 5, "Average the last N checkpoints.", flag_values=flag_values)
  app.check_flag("last", Int(min=1), flag_values)


def main() -> None:
  out = write_average(flags.FLAGS.workdir, flags.FLAGS.last)
  print(f"averaged the last {flags.FLAGS.last} checkpoints into {out}")


if __name__ == "__main__":
  define_flags()
  app.run(main, prog="cli.average")
