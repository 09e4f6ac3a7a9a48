"""Translates text with a trained model, and scores it against references when given: the command
line over `inference.translator.Translator`.

    python decode.py --workdir=/tmp/tiny < source.txt > translations.txt
    python decode.py --workdir=/tmp/tiny --split=test --json=test.json
    python decode.py --workdir=runs/base --input=newstest2014.en --reference=newstest2014.de \
        --checkpoint=average:5 --beam_size=4 --alpha=0.6
    python decode.py --workdir=runs/base --split=test --checkpoint=ensemble:3   # 3 models at once
    python decode.py --workdir=/tmp/tiny --input=src.txt --target_prefix=prefixes.txt

Everything (parameters, config, vocabulary) comes from the workdir. Translations are written one
per line in input order; an empty input line gives an empty output line. With references the
sacreBLEU score lines go to stdout, or to stderr when the translations do. Inputs, outputs and
options are checked before anything is decoded. Exit status 2: bad usage or input; 1: a failure
while running.
"""

from __future__ import annotations

import time

_STARTED = time.perf_counter()  # the run's start-up: imports until the main begins

if __name__ == "__main__":  # first, before JAX starts its threads: see cli/host_memory.py
  import gc
  import os

  # numpy's OpenBLAS starts a thread per further core when numpy is imported, and each spins
  # waiting for work; decoding runs no numpy matrix product (XLA has its own), so it gets one.
  os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

  from cli.host_memory import keep_freed_memory_on_cpu

  keep_freed_memory_on_cpu(single_arena=False)  # compiles in parallel: see its docstring
  gc.disable()  # no collections while importing: turned on again below, the imports frozen

from absl import flags  # noqa: E402

from cli import app  # noqa: E402
from cli import decode as command  # noqa: E402
from cli.decode import FLAG_NAMES, main  # noqa: E402


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """cli/decode.py's flags, shown by --help as this script's own."""
  command.define_flags(flag_values)
  flags.adopt_module_key_flags(command, flag_values=flag_values)


if __name__ == "__main__":
  define_flags()
  gc.freeze()  # what the imports made: never scanned by a collection again (nor collected)
  gc.enable()
  app.run(lambda: main(_STARTED), prog="decode.py", flag_names=FLAG_NAMES, skip_teardown=True)
