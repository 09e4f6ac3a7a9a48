"""Fetches a corpus ahead of time, for machines that will train without a network (a cluster's
compute nodes):

    python -m cli.fetch multi30k              # every split, into ~/.cache/attention-jax/multi30k
    python -m cli.fetch multi30k --to=DIR     # into DIR; then train with --config.data.dir=DIR
    python -m cli.fetch multi30k --splits=train,val,test_2016_flickr --url=<mirror>

Each file is checked against its digest and written atomically (data/multi30k.py,
data/download.py); one already there with the expected digest is kept. Run on a login node
whose home folder the compute nodes share, the cache it fills is the one `train.py` and
`decode.py` read there (the same `$XDG_CACHE_HOME`, or `~/.cache`). Exit status 2 for bad usage,
1 when a file cannot be fetched (one line: the URL, what went wrong, the way round it).
"""

from __future__ import annotations

import pathlib
import sys

from absl import flags

from cli import app
from core.errors import USAGE, UsageError
from data import multi30k

PROG = "cli.fetch"
DATASETS = (multi30k.NAME,)
_HELP = ("--help", "-h", "--helpshort", "--helpfull", "-?")


def fetch_multi30k(splits, folder: pathlib.Path, url: str) -> list[pathlib.Path]:
  """Every language's file of each of `splits` in `folder`, fetched from `url` where missing."""
  for split in splits:
    try:
      multi30k.check(split, multi30k.LANGUAGES, "--splits")
    except ValueError as e:
      raise UsageError(str(e)) from None
  try:
    multi30k.check_url(url, "--url")
  except ValueError as e:
    raise UsageError(str(e)) from None
  if folder.exists() and not folder.is_dir():
    raise UsageError(f"--to={folder}: not a folder")
  return [
    p for split in splits for p in multi30k.local_files(split, multi30k.LANGUAGES, url, folder)
  ]


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """This command line's flags, defined only when it runs (cli/app.py)."""
  define = dict(flag_values=flag_values)
  flags.DEFINE_string(
    "to",
    "",
    f"Folder to fetch into; '' = the cache train.py reads ({multi30k.cache_folder()}).",
    **define,
  )
  flags.DEFINE_list(
    "splits", list(multi30k.SPLITS), "Splits to fetch (each in en and de).", **define
  )
  flags.DEFINE_string(
    "url",
    multi30k.DEFAULT_URL,
    f"Base URL to which {multi30k.RAW}/<split>.<lang>.gz is appended (a mirror's).",
    **define,
  )


def main() -> None:
  to = flags.FLAGS.to
  folder = pathlib.Path(to).expanduser() if to else multi30k.cache_folder()
  paths = fetch_multi30k(flags.FLAGS.splits, folder, flags.FLAGS.url)
  size = sum(p.stat().st_size for p in paths)
  print(f"{multi30k.NAME}: {len(paths)} files ({size:,} bytes) in {folder}, digests checked")
  if to:
    print(f"train with --config.data.dir={folder} (or copy them into {multi30k.cache_folder()})")


def _without_dataset(argv: list[str]) -> list[str]:
  """`argv` without its first argument, the dataset's name; a missing or unknown name is one line
  and exit status 2 (help flags pass)."""
  if len(argv) > 1 and argv[1] in DATASETS:
    return argv[:1] + argv[2:]
  if len(argv) > 1 and not argv[1].startswith("-"):
    app.fail(PROG, f"unknown dataset {argv[1]!r}; it fetches: {', '.join(DATASETS)}", USAGE)
  if not any(a.split("=")[0] in _HELP for a in argv[1:]):
    app.fail(PROG, f"name the dataset first: python -m {PROG} multi30k [--to=DIR]", USAGE)
  return argv


if __name__ == "__main__":
  define_flags()
  sys.argv = _without_dataset(sys.argv)
  app.run(main, prog=PROG)
