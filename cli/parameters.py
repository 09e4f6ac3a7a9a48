"""Prints a model's parameter table without allocating it (analysis/parameters.py).

    python -m cli.parameters --config=configs/wmt14_ende_base.py

The last line is `params: <N>`.
"""

from __future__ import annotations

from absl import flags

from analysis.parameters import parameter_table
from cli import app
from core.errors import UsageError
from model.build import abstract_params


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """This command line's flags, defined only when it runs (cli/app.py)."""
  app.define_config(flag_values)


def main() -> None:
  cfg = app.load_config()
  if cfg.model.vocab_size <= 0:
    raise UsageError(
      "model.vocab_size must be set (e.g. --config.model.vocab_size=37000) to "
      "count parameters without a vocabulary"
    )
  rows = parameter_table(abstract_params(cfg.model))
  width = max(len(r[0]) for r in rows)
  for name, shape, size in rows:
    print(f"{name:<{width}}  {str(shape):<20} {size:>12,}")
  print(f"params: {sum(r[2] for r in rows)}")


if __name__ == "__main__":
  define_flags()
  app.run(main, prog="cli.parameters")
