"""Command-line parsing shared by train.py, decode.py, bench.py and model.summary: turns a mistyped
`--config.<field>=...` override into one clear line instead of a traceback."""
from __future__ import annotations

import sys

from absl import flags


def parse(argv: list[str]) -> list[str]:
  """absl `flags_parser` for `app.run`: parses `argv`, exits with status 2 and a message naming
  the field when an override names a config field that does not exist."""
  try:
    return flags.FLAGS(argv)
  except (AttributeError, KeyError) as e:
    bad = [a.split("=", 1)[0].lstrip("-") for a in argv[1:] if a.startswith("--config.")]
    missing = str(e).strip("\"'")
    named = [b for b in bad if b.split(".")[-1] == missing] or bad
    sys.stderr.write(f"config error: unknown config field {named[0] if named else missing!r} "
                     f"(no field {missing!r}); see configs/common.py for every field\n")
    sys.exit(2)
  except flags.Error as e:
    sys.stderr.write(f"FATAL Flags parsing error: {e}\n")
    sys.exit(2)
