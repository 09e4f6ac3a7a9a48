"""The one runner of every command line here: train.py, decode.py, bench.py and the `python -m`
tools. Each command line defines its flags in a function `define_flags()`, called only by its
`if __name__ == "__main__":` block, so that importing the module for its library functions defines
no flag (two command lines' `--workdir` or `--json` would clash in one process, e.g. pytest's):

    def define_flags(flag_values=flags.FLAGS):
      cli.app.define_config(flag_values)     # --config and --show_config (train.py, bench.py)
      flags.DEFINE_string("workdir", None, "...", flag_values=flag_values)
    def main(): config = cli.app.load_config(); workdir = flags.FLAGS.workdir; ...
    if __name__ == "__main__":
      define_flags()
      cli.app.run(main, prog="bench.py")

`run` parses the flags with absl (a mistyped `--config.<field>=...` override, or a config file
that cannot be loaded, is one line naming it), prints the resolved config and exits for
`--show_config`, installs the command lines' logging policy (core/logs.py) and their way to end
the process at once (cli/exit.py, for core/ending.py), calls `main()` and
turns the errors a user can act on (`core/errors.py`) into one line `<prog>: error: <message>`
with the exit status of their kind: 2 for bad usage or input, 1 for a failure while running. The
library names its arguments as Python does (`checkpoint='x': ...`); an `ArgumentError` whose
argument came from a flag of this command line is printed as the flag (`--checkpoint=x: ...`).
Any other exception is a bug and keeps its traceback; so does every error when
`ATTENTION_JAX_TRACEBACK=1` is set.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable

from absl import app, flags, logging

from cli.exit import ending_line, exit_now
from core import ending, errors, logs
from core.rules import Rule, RuleError


def fail(prog: str, text: str, status: int) -> None:
  """Prints `<prog>: error: <text>` to stderr and exits with `status`."""
  sys.stderr.write(f"{prog}: error: {text}\n")
  sys.stderr.flush()
  sys.exit(status)


def check_flag(name: str, rule: Rule, flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """Registers `rule` (core/rules.py) as the validator of the absl flag `--name` (unset flags,
  None, pass): a value that breaks it stops the parsing with `flag --name=<value>: must be ...`
  (exit 2)."""

  def checker(value) -> bool:
    if value is None:
      return True
    try:
      rule.check(value)
    except RuleError as e:
      raise flags.ValidationError(str(e)) from None
    return True

  flags.register_validator(name, checker, flag_values=flag_values)


def define_config(flag_values=flags.FLAGS):
  """Defines `--config` (a configs/*.py file, fields overridable as --config.<field>=<value>) and
  `--show_config`; returns the config's flag holder."""
  from ml_collections import config_flags  # train.py's and bench.py's: decode.py runs without

  holder = config_flags.DEFINE_config_file(
    "config",
    None,
    "Config file (configs/*.py); --config.<field>=<value> overrides a field.",
    flag_values=flag_values,
    lock_config=True,
  )
  flags.DEFINE_bool(
    "show_config",
    False,
    "Print every field of the resolved config (the file and its overrides) "
    "with its value and what it means, then exit.",
    flag_values=flag_values,
  )
  return holder


def load_config(holder=None):
  """The resolved config of `holder` (default: the `--config` flag); a config file that cannot be
  loaded is a UsageError naming it (ml_collections defers a missing file's error to the first use
  of the config)."""
  config = (holder if holder is not None else flags.FLAGS["config"]).value
  try:
    config.keys()
  except OSError as e:
    reason = str(e).strip().splitlines()[-1].strip()
    raise errors.UsageError(f"--config={_config_path()}: cannot load it: {reason}") from None
  return config


def _config_path() -> str:
  from ml_collections import config_flags

  return config_flags.get_config_filename(flags.FLAGS["config"])


def parse_flags(argv: list[str], prog: str) -> list[str]:
  """Parses `argv` into absl's FLAGS; a bad flag, an unknown config field or a config file that
  does not run is one line and exit status 2."""
  try:
    return flags.FLAGS(argv)
  except (AttributeError, KeyError) as e:  # ml_collections: an override of a missing field
    fail(prog, _unknown_field(argv, e), errors.USAGE)
  except flags.Error as e:
    fail(prog, str(e), errors.USAGE)
  except Exception as e:  # noqa: BLE001 - the config file's own code failed while loading
    where = f" (line {e.lineno})" if isinstance(e, SyntaxError) and e.lineno else ""
    path = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), "--config")
    fail(prog, f"--config={path}: cannot load it{where}: {type(e).__name__}: {e}", errors.USAGE)
  raise AssertionError("unreachable")


def _unknown_field(argv: list[str], e: Exception) -> str:
  """'unknown config field ...' naming the override's field as the user typed it."""
  overrides = [a.split("=", 1)[0].lstrip("-") for a in argv[1:] if a.startswith("--config.")]
  text = str(e).encode().decode("unicode_escape")
  names = re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text)
  missing = names[0] if names else text
  hint = re.search(r'Did you mean "([^"]+)"', text)
  # The override naming the missing field: its last part (`model.nope`), else any part (a missing
  # group, `early_stopping.patience`); never another override, valid, given before it.
  named = [o for o in overrides if o.split(".")[-1] == missing] or [
    o for o in overrides if missing in o.split(".")[1:]
  ]
  return (
    f"unknown config field {named[0] if named else missing!r}"
    + (f" (did you mean {hint.group(1)!r}?)" if hint else "")
    + "; see configs/common.py for every field"
  )


def error_line(
  error: BaseException,
  flag_names: dict[str, str] | None = None,
  flag_values: flags.FlagValues = flags.FLAGS,
) -> str:
  """The message of `error` as a command line prints it: an `ArgumentError` names the flag of its
  argument (`flag_names` maps argument names to flag names where they differ) when this command
  line defines that flag, and so does a `ValueError` whose message starts `<argument>=` (as
  SearchSettings' do); else it stays as the library wrote it."""
  names = flag_names or {}
  if isinstance(error, errors.ArgumentError):
    flag = names.get(error.name, error.name)
    if flag in flag_values:
      return error.as_flag(flag)
  text = errors.message(error)
  if isinstance(error, ValueError):
    name, equals, rest = text.partition("=")
    flag = names.get(name, name)
    if equals and name.isidentifier() and flag in flag_values:
      return f"--{flag}={rest}"
  return text


def run(
  main: Callable[[], object],
  prog: str,
  config=None,
  flag_names: dict[str, str] | None = None,
  skip_teardown: bool = False,
) -> None:
  """absl's `app.run` of `main()` (no arguments: it reads its flags) with the parsing and error
  handling above. Positional arguments are a usage error: every input is a flag. `--show_config`,
  where defined, prints the config (of `config`, a holder from `define_config`; default the
  `--config` flag) instead of running. `flag_names`: as `error_line`.

  `skip_teardown`: once `main()` has returned, flush the logs, stdout and stderr and end the
  process with status 0 at once (cli/exit.py), skipping Python's shutdown, whose teardown of
  JAX's objects is a noticeable part of a short decode.py run (docs/experiments.md). `main`
  must have closed every file it wrote; an error still ends the process as without."""

  def body(argv: list[str]) -> None:
    if len(argv) > 1:
      fail(prog, f"unexpected arguments: {' '.join(argv[1:])} (every input is a --flag)", 2)
    logs.command_line_logs()
    try:
      if "show_config" in flags.FLAGS and flags.FLAGS.show_config:
        from configs.common import describe  # here: a command without configs imports no JAX

        print("\n".join(describe(load_config(config))))
        return
      previous = ending.install(ending_line(prog))  # a lost process, a hung stop: core/ending.py
      try:
        main()
      finally:
        ending.install(previous)
    except Exception as e:  # noqa: BLE001 - sorted into expected (one line) and bugs (traceback)
      status = errors.exit_status(e)
      if status is None or os.environ.get(errors.TRACEBACK_ENV):
        raise
      fail(prog, error_line(e, flag_names), status)

  try:
    app.run(body, flags_parser=lambda argv: parse_flags(argv, prog))
  except SystemExit as e:
    if not skip_teardown or e.code not in (None, 0):
      raise
    try:
      logging.flush()
      sys.stdout.flush()
      sys.stderr.flush()
    except (OSError, ValueError):  # a closed stream: Python's own exit reports it
      raise e from None
    exit_now(0)
