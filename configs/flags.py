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
    import re

    bad = [a.split("=", 1)[0].lstrip("-") for a in argv[1:] if a.startswith("--config.")]
    text = str(e).encode().decode("unicode_escape")
    names = re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text)
    missing = names[0] if names else text
    hint = re.search(r'Did you mean "([^"]+)"', text)
    named = [b for b in bad if b.split(".")[-1] == missing] or bad
    sys.stderr.write(
      f"config error: unknown config field {named[0] if named else missing!r}"
      + (f" (did you mean {hint.group(1)!r}?)" if hint else "")
      + "; see configs/common.py for every field\n"
    )
    sys.exit(2)
  except flags.Error as e:
    sys.stderr.write(f"FATAL Flags parsing error: {e}\n")
    sys.exit(2)
