"""Text files of the command lines: input lines read whole (plain or gzip, UTF-8, '-' = stdin)
with errors that name the file and line, output lines written whole, and output paths checked
before any work, so that hours of decoding are never lost to a folder that does not exist.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import os
import pathlib
import sys
import zlib
from collections.abc import Iterator

from core.errors import UsageError

GZIP_MAGIC = b"\x1f\x8b"


def read_lines(path: str | None, what: str = "--input") -> list[str]:
  """Lines of a UTF-8 text file, gzip-compressed or not ('-' or None = stdin), without their line
  terminators. `what` names the input in errors (a flag, e.g. '--reference')."""
  return list(iter_lines(path, what))


def iter_lines(path: str | None, what: str = "--input") -> Iterator[str]:
  """The lines of a UTF-8 text file, gzip-compressed or not ('-' or None = stdin), without their
  line terminators, one at a time as they arrive (stdin from a terminal: as typed), holding one
  line in memory. `what` names the input in errors (a flag, e.g. '--reference'): a UsageError
  naming the line for invalid UTF-8, or for a damaged gzip stream, raised when the reading gets
  there (`check_lines` first, for a file)."""
  name = "stdin" if path in (None, "-") else f"{what}={path}"
  try:
    raw = sys.stdin.buffer if name == "stdin" else open(path, "rb")
    with contextlib.ExitStack() as stack:
      if raw is not sys.stdin.buffer:
        stack.enter_context(raw)
      if not hasattr(raw, "peek"):  # a stdin replaced by an in-memory stream: left open
        raw = io.BufferedReader(raw)
        stack.callback(raw.detach)
      if raw.peek(2)[:2] == GZIP_MAGIC:
        raw = stack.enter_context(gzip.open(raw, "rb"))
      for number, line in enumerate(iter(raw.readline, b""), start=1):
        try:
          yield line.rstrip(b"\n").decode("utf-8").rstrip("\r")
        except UnicodeDecodeError as e:
          raise UsageError(
            f"{name}, line {number}: invalid UTF-8 ({e.reason} at byte {e.start})"
          ) from None
  except (OSError, EOFError, zlib.error) as e:
    reason = getattr(e, "strerror", None) or str(e) or type(e).__name__
    raise UsageError(f"{name}: cannot read: {reason}") from None


def check_lines(path: str | None, what: str = "--input") -> int:
  """Reads a file through (not stdin) as `iter_lines` does, keeping nothing: its number of lines,
  or the UsageError a bad line gives, before any of it is used."""
  if path in (None, "-"):
    return -1
  return sum(1 for _ in iter_lines(path, what))


def read_aligned(sources: str | None, references: str | None) -> tuple[list[str], list[str] | None]:
  """(lines of --input `sources`, lines of --reference `references` or None), a UsageError
  unless they have as many lines."""
  source_lines = read_lines(sources, "--input")
  if not references:
    return source_lines, None
  reference_lines = read_lines(references, "--reference")
  if len(reference_lines) != len(source_lines):
    raise UsageError(
      f"--reference={references} has {len(reference_lines)} lines, the input has "
      f"{len(source_lines)}"
    )
  return source_lines, reference_lines


def write_lines(path: str, lines: list[str], what: str = "--output") -> None:
  """Writes `lines` to `path` ('-' = stdout), one per line."""
  data = "".join(line + "\n" for line in lines).encode("utf-8")
  if path == "-":
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()
    return
  try:
    pathlib.Path(path).write_bytes(data)
  except OSError as e:
    raise UsageError(f"{what}={path}: cannot write: {e.strerror or e}") from None


def check_writable(path: str | None, what: str) -> None:
  """Raises UsageError unless `path` (None and '-' pass) can be written: its folder exists and
  is writable, and it is not a folder itself. Creates nothing."""
  if path in (None, "", "-"):
    return
  target = pathlib.Path(path)
  folder = target.parent if str(target.parent) else pathlib.Path(".")
  if target.is_dir():
    raise UsageError(f"{what}={path}: is a folder, not a file")
  if not folder.is_dir():
    raise UsageError(f"{what}={path}: the folder {folder} does not exist")
  if not os.access(folder, os.W_OK | os.X_OK) or (
    target.exists() and not os.access(target, os.W_OK)
  ):
    raise UsageError(f"{what}={path}: not writable")
