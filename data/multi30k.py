"""Multi30k, task 1 (English-German image captions, Elliott et al. 2016): fetched from its
official repository at a pinned commit, checked, and kept in a per-user cache.

    local_files("train", ("en", "de"))   # -> [.../train.en.gz, .../train.de.gz], fetched if missing

The first use of a split downloads `<data.url>/data/task1/raw/<split>.<lang>.gz` (by default
the repository at COMMIT on raw.githubusercontent.com) into `cache_folder()`,
`$XDG_CACHE_HOME/attention-jax/multi30k` or else `~/.cache/attention-jax/multi30k`, checked
against DIGESTS and written atomically (data/download.py); later uses read the cache, checking
each file again, without touching the network (a cached file that does not match is discarded and
fetched again). `python -m cli.fetch multi30k` fetches every split ahead of time.

Where the digests come from:
* train, val, test_2016_flickr (en, de): sha256 of byte-identical copies of the repository's files
  at COMMIT (the project's reference copy and its SOURCE.md, which gives the commit and these
  hashes).
* test_2017_flickr, test_2017_mscoco, test_2018_flickr: the project had no copy of these files, so
  no sha256 could be computed. Their MD5s are the ones published for the same paths of the
  repository's `master` branch (whose head, when the reference copy was made, was COMMIT) by
  torchtext (pytorch/text, torchtext/datasets/multi30k.py, its 2021 table SUPPORTED_DATASETS: the
  2017 files and test_2018_flickr.en) and by sacreBLEU 2.6.0 (sacrebleu/dataset/__init__.py,
  "multi30k/2018": test_2018_flickr.de). torchtext's MD5s of the six files above all match the
  reference copy. These three splits' files have not been downloaded and checked here: should the
  repository's files differ, their fetch fails with a checksum error naming both digests, and
  `data.dir` (a folder of files you fetched yourself) is the way round it.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterable, Sequence

from absl import logging

from data import download

NAME = "multi30k"
REPOSITORY = "https://github.com/multi30k/dataset"
COMMIT = "a3d2e0d26b56f3846f66a952536ffed4e401d05a"
DEFAULT_URL = f"https://raw.githubusercontent.com/multi30k/dataset/{COMMIT}"
RAW = "data/task1/raw"
SPLITS = (
  "train",
  "val",
  "test_2016_flickr",
  "test_2017_flickr",
  "test_2017_mscoco",
  "test_2018_flickr",
)
LANGUAGES = ("en", "de")
URL_SCHEMES = ("http://", "https://", "file://")

_SHA256 = {  # SOURCE.md of the reference copy; sha256sum of its files gives the same
  "train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
  "train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
  "val.en.gz": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
  "val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
  "test_2016_flickr.en.gz": "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
  "test_2016_flickr.de.gz": "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
}
_MD5 = {  # published by torchtext (2017 files, 2018 en) and sacreBLEU 2.6.0 (2018 de): see above
  "test_2017_flickr.en.gz": "005396bac545d880abe6f00bbb7dbbb4",
  "test_2017_flickr.de.gz": "6a8d5c87f6ae19e3d35681aa6fd16571",
  "test_2017_mscoco.en.gz": "a7b684e0edbef1d4a23660c8e8e743fd",
  "test_2017_mscoco.de.gz": "e8cd6ec2bc8a11fc846fa48a46e3d0bb",
  "test_2018_flickr.en.gz": "a152878809942757a55ce087073486b8",
  "test_2018_flickr.de.gz": "87e00327083dd69feaa029a8f7c1a047",
}
DIGESTS: dict[str, download.Digest] = {
  **{name: download.Digest("sha256", h) for name, h in _SHA256.items()},
  **{name: download.Digest("md5", h) for name, h in _MD5.items()},
}


def file_name(split: str, lang: str) -> str:
  """`<split>.<lang>.gz`, the name in the repository and in the cache."""
  return f"{split}.{lang}.gz"


def file_url(base_url: str, split: str, lang: str) -> str:
  """`<base_url>/data/task1/raw/<split>.<lang>.gz`."""
  return f"{base_url.rstrip('/')}/{RAW}/{file_name(split, lang)}"


def cache_folder(environ=os.environ) -> pathlib.Path:
  """`$XDG_CACHE_HOME/attention-jax/multi30k`, else `~/.cache/attention-jax/multi30k`."""
  base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(base) / "attention-jax" / NAME


def check(split: str, langs: Iterable[str], what: str | None = None) -> None:
  """Raises ValueError unless `split` and every language of `langs` are Multi30k's (`what`
  names the split's field or flag in the message, e.g. 'data.train_split')."""
  if split not in SPLITS:
    has = f"(it has {', '.join(SPLITS)})"
    if what:
      raise ValueError(f"{what}={split!r} is not a Multi30k split {has}")
    raise ValueError(f"no Multi30k split {split!r} {has}")
  for lang in langs:
    if lang not in LANGUAGES:
      raise ValueError(
        f"language {lang!r} (data.source_lang, data.target_lang) is not one of Multi30k's "
        f"here ({', '.join(LANGUAGES)}); for another, put its files in a folder and set "
        f"data.name=files and data.dir"
      )


def check_url(url: str, what: str = "data.url") -> None:
  """Raises ValueError unless `url` is an http(s):// or file:// URL (`what` names it)."""
  if not url.startswith(URL_SCHEMES):
    raise ValueError(
      f"{what}={url!r} is not an http://, https:// or file:// URL (the base to which "
      f"{RAW}/<split>.<lang>.gz is appended)"
    )


def manual_way(split: str, langs: Sequence[str], folder: pathlib.Path) -> str:
  """How to get the files without this process's network."""
  files = " and ".join(file_name(split, lang) for lang in langs)
  return (
    f"to get them by hand, put {files} from {REPOSITORY}/tree/{COMMIT}/{RAW} in {folder} (or run "
    f"`python -m cli.fetch {NAME}` where there is a network), or set data.url to a mirror, or "
    f"data.dir to a folder of <split>.<lang>[.gz] files"
  )


def local_files(
  split: str,
  langs: Sequence[str],
  url: str = DEFAULT_URL,
  folder: str | os.PathLike | None = None,
  **download_options,
) -> list[pathlib.Path]:
  """The files of `split` in `langs` in `folder` (default `cache_folder()`), each fetched from
  `url` first unless it is there with the expected digest. `download_options`: `tries`,
  `backoff_s`, `timeout_s` of `download.download`.

  Raises:
    ValueError: `split` or a language is not Multi30k's.
    download.DownloadError: a file could not be fetched or did not match its digest; the message
      says how to do without the network.
  """
  check(split, langs)
  check_url(url)
  folder = pathlib.Path(folder) if folder else cache_folder()
  paths = []
  for lang in langs:
    name = file_name(split, lang)
    path, digest = folder / name, DIGESTS[name]
    if path.is_file():
      got = digest.of_file(path)
      if got == digest.hexdigest:
        paths.append(path)
        continue
      logging.warning(
        "%s has %s %s, not the expected %s: discarded, fetching it again",
        path,
        digest.algorithm,
        got,
        digest.hexdigest,
      )
      path.unlink()
    try:
      download.download(file_url(url, split, lang), path, digest, **download_options)
    except download.DownloadError as e:
      raise type(e)(f"{e}; {manual_way(split, langs, folder)}") from None
    paths.append(path)
  return paths


def identity(split: str, langs: Sequence[str]) -> list[list[str]]:
  """What identifies the text of `split` without reading it: `[name, digest]` of each file (the
  same on every machine, whatever the cache folder)."""
  return [[file_name(split, lang), str(DIGESTS[file_name(split, lang)])] for lang in langs]
