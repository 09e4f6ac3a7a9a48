"""The one runner of every command line here: train.py, decode.py, bench.py and the `python -m`
tools.

    if __name__ == "__main__":
      cli.app.run(main, prog="train.py")

`run` parses the flags with absl (a mistyped `--config.<field>=...` override is one line naming
the field), calls `main()` and turns the errors a user can act on (`cli/errors.py`) into one line
`<prog>: error: <message>` with the exit status of their kind: 2 for bad usage or input, 1 for a
failure while running. Any other exception is a bug and keeps its traceback; so does every error
when `ATTENTION_JAX_TRACEBACK=1` is set.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable

from absl import app, flags

from cli import errors, logs

TRACEBACK_ENV = "ATTENTION_JAX_TRACEBACK"


def fail(prog: str, text: str, status: int) -> None:
  """Prints `<prog>: error: <text>` to stderr and exits with `status`."""
  sys.stderr.write(f"{prog}: error: {text}\n")
  sys.stderr.flush()
  sys.exit(status)


def parse_flags(argv: list[str], prog: str) -> list[str]:
  """Parses `argv` into absl's FLAGS; a bad flag or an unknown config field is one line and exit
  status 2."""
  try:
    return flags.FLAGS(argv)
  except (AttributeError, KeyError) as e:  # ml_collections: an override of a missing field
    fail(prog, _unknown_field(argv, e), errors.USAGE)
  except flags.Error as e:
    fail(prog, str(e), errors.USAGE)
  raise AssertionError("unreachable")


def _unknown_field(argv: list[str], e: Exception) -> str:
  """'unknown config field ...' naming the override's field as the user typed it."""
  overrides = [a.split("=", 1)[0].lstrip("-") for a in argv[1:] if a.startswith("--config.")]
  text = str(e).encode().decode("unicode_escape")
  names = re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text)
  missing = names[0] if names else text
  hint = re.search(r'Did you mean "([^"]+)"', text)
  named = [o for o in overrides if o.split(".")[-1] == missing] or overrides
  return (
    f"unknown config field {named[0] if named else missing!r}"
    + (f" (did you mean {hint.group(1)!r}?)" if hint else "")
    + "; see configs/common.py for every field"
  )


def run(main: Callable[[], object], prog: str) -> None:
  """absl's `app.run` of `main()` (no arguments: it reads its flags) with the parsing and error
  handling above. Positional arguments are a usage error: every input is a flag."""

  def body(argv: list[str]) -> None:
    if len(argv) > 1:
      fail(prog, f"unexpected arguments: {' '.join(argv[1:])} (every input is a --flag)", 2)
    logs.quiet_library_logs()
    try:
      main()
    except Exception as e:  # noqa: BLE001 - sorted into expected (one line) and bugs (traceback)
      status = errors.exit_status(e)
      if status is None or os.environ.get(TRACEBACK_ENV):
        raise
      fail(prog, errors.message(e), status)

  app.run(body, flags_parser=lambda argv: parse_flags(argv, prog))
