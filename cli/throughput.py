"""How fast the input pipeline produces training batches:

    python -m cli.throughput --name=multi30k --eval_split=val --workdir=/tmp/m30k [--nopacking]

builds the pipeline (training the vocabulary and filling the token cache on the first run), then
prints batches/s and non-padding tokens/s of the training iterator (data/throughput.py).
"""

from __future__ import annotations

import time

import ml_collections
from absl import flags

from cli import app
from configs.common import FIELDS, data_defaults
from core.rules import Float, Int
from data import pipeline
from data.throughput import measure_throughput


def main() -> None:
  data = ml_collections.ConfigDict({key: flags.FLAGS[key].value for key in data_defaults()})
  config = ml_collections.ConfigDict({"seed": 0, "data": data})
  start = time.perf_counter()
  pipe = pipeline.build(config, flags.FLAGS.workdir, batch_multiple=flags.FLAGS.batch_multiple)
  print(
    f"build: {time.perf_counter() - start:.1f} s; shapes {pipe.batch_shapes}; "
    f"stats {pipe.stats[data.train_split]}"
  )
  result = measure_throughput(pipe.train_iter(), flags.FLAGS.seconds)
  print(
    f"{result['batches']} batches: {result['batches_per_s']:.1f} batches/s, "
    f"{result['tokens_per_s'] / 1e6:.2f} M tokens/s (source+target, non-pad), "
    f"{result['target_tokens_per_s'] / 1e6:.2f} M target tokens/s"
  )


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """This command line's flags, defined only when it runs (cli/app.py): --workdir, --seconds,
  --batch_multiple and one flag per `config.data` field (as named and checked in
  configs/common.py)."""
  flags.DEFINE_string(
    "workdir",
    None,
    "Holds the vocabulary and token cache.",
    required=True,
    flag_values=flag_values,
  )
  flags.DEFINE_float("seconds", 10.0, "How long to pull batches.", flag_values=flag_values)
  flags.DEFINE_integer(
    "batch_multiple", 1, "Row multiple of every global batch.", flag_values=flag_values
  )
  app.check_flag("seconds", Float(above=0.0), flag_values)
  app.check_flag("batch_multiple", Int(min=1), flag_values)
  define = {bool: flags.DEFINE_bool, int: flags.DEFINE_integer, str: flags.DEFINE_string}
  for key, value in data_defaults().items():
    field = FIELDS[f"data.{key}"]
    define[type(value)](key, value, f"config.data.{key}: {field.help}", flag_values=flag_values)
    app.check_flag(key, field.rule, flag_values)


if __name__ == "__main__":
  define_flags()
  app.run(main, prog="cli.throughput")
