"""Raw parallel text: `(source_text, target_text)` pairs for one split of a corpus.

Four kinds of corpus, chosen by `config.data.name`:

* `'files'`: line-aligned text files `<data.dir>/<split>.<lang>` (or `.gz`).
* `'multi30k'`: Multi30k's task 1, fetched on first use into a per-user cache (data/multi30k.py);
  with `data.dir` set, read from there like `'files'` and nothing is fetched.
* `'synthetic'`: a built-in task, generated from a seed, nothing to download: the target is the
  source sentence reversed, with every word renamed through a fixed permutation.
* anything else: a TensorFlow Datasets translation builder such as `'wmt14_translate/de-en'`.

Every source strips surrounding whitespace from each side and skips pairs where either side is
empty; `SplitStats` counts what was kept and skipped. `load_split` is the single entry point.
"""

from __future__ import annotations

import dataclasses
import gzip
import os
import pathlib
import zlib
from collections.abc import Iterable, Iterator

import numpy as np
from absl import logging

from data import multi30k

Pair = tuple[str, str]

SYNTHETIC = "synthetic"
FILES = "files"
MULTI30K = multi30k.NAME
SYNTHETIC_SPLITS = ("train", "validation", "test")


@dataclasses.dataclass
class SplitStats:
  """Counts of one split read: `pairs` kept, `skipped_empty` pairs with an empty side."""

  pairs: int = 0
  skipped_empty: int = 0


def _clean(pairs: Iterable[tuple[str, str]], stats: SplitStats) -> Iterator[Pair]:
  """Strips both sides and drops pairs with an empty side, counting both in `stats`."""
  for src, tgt in pairs:
    src, tgt = src.strip(), tgt.strip()
    if src and tgt:
      stats.pairs += 1
      yield src, tgt
    else:
      stats.skipped_empty += 1


# --------------------------------------------------------------------------------------------------
# Parallel text files.


def split_file(directory: str | os.PathLike, split: str, lang: str) -> pathlib.Path:
  """`<directory>/<split>.<lang>`, or `<split>.<lang>.gz` when only that one exists."""
  plain = pathlib.Path(directory) / f"{split}.{lang}"
  gz = plain.with_name(plain.name + ".gz")
  for path in (plain, gz):
    if path.is_file():
      return path
  raise FileNotFoundError(f"split {split!r}, language {lang!r}: neither {plain} nor {gz} exists")


def _open(path: pathlib.Path):
  return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _count_lines(path: pathlib.Path) -> int:
  count, last = 0, b"\n"
  try:
    with _open(path) as f:
      while chunk := f.read(1 << 20):
        count += chunk.count(b"\n")
        last = chunk[-1:]
  except (OSError, EOFError, zlib.error) as e:  # unreadable, or a damaged gzip header or body
    reason = getattr(e, "strerror", None) or str(e) or type(e).__name__
    raise ValueError(f"{path}: cannot read: {reason}") from None
  return count + (last != b"\n")  # a last line without a newline still counts


def _decoded_lines(path: pathlib.Path) -> Iterator[str]:
  with _open(path) as f:
    for number, line in enumerate(f, start=1):
      try:
        yield line.decode("utf-8")
      except UnicodeDecodeError as e:
        raise ValueError(
          f"{path}, line {number}: invalid UTF-8 ({e.reason} at byte {e.start})"
        ) from None


def read_parallel_files(
  source_path: str | os.PathLike, target_path: str | os.PathLike, stats: SplitStats | None = None
) -> Iterator[Pair]:
  """Pairs of line `i` of `source_path` with line `i` of `target_path` (plain or `.gz`, UTF-8).

  The files are read and their line counts checked before this returns; invalid UTF-8, and files
  whose every line pair has an empty side, raise while iterating.

  Raises:
    ValueError: a file cannot be read (missing, unreadable, a damaged gzip file), the files are
      empty or have different line counts (naming both files and counts), a line is not valid
      UTF-8 (naming the file and the 1-based line number), or no pair has two non-empty sides.
  """
  source_path, target_path = pathlib.Path(source_path), pathlib.Path(target_path)
  n_src, n_tgt = _count_lines(source_path), _count_lines(target_path)
  if n_src != n_tgt:
    raise ValueError(
      f"parallel files are not line-aligned: {source_path} has {n_src} lines, "
      f"{target_path} has {n_tgt} lines"
    )
  if not n_src:
    raise ValueError(f"{source_path} and {target_path} are empty: no sentence pairs to read")
  stats = stats if stats is not None else SplitStats()
  pairs = _clean(zip(_decoded_lines(source_path), _decoded_lines(target_path)), stats)
  return _some_pairs(pairs, stats, f"{source_path} and {target_path}")


def _some_pairs(pairs: Iterator[Pair], stats: SplitStats, files: str) -> Iterator[Pair]:
  """`pairs`, then a ValueError naming `files` if none was kept (SentencePiece would fail on no
  text with an internal error naming no file)."""
  yield from pairs
  if not stats.pairs:
    raise ValueError(f"{files}: every line pair has an empty side: no sentence pairs to read")


def parallel_files(config_data, split: str) -> tuple[pathlib.Path, pathlib.Path]:
  """The source and target files of `split`: in `data.dir` when it is set; else, for
  data.name='multi30k', in the cache, fetched from `data.url` when missing."""
  langs = (config_data.source_lang, config_data.target_lang)
  if config_data.dir:
    paths = [split_file(config_data.dir, split, lang) for lang in langs]
  elif config_data.name == MULTI30K:
    paths = multi30k.local_files(split, langs, config_data.get("url") or multi30k.DEFAULT_URL)
  else:
    raise ValueError("data.name='files' needs data.dir, the folder of <split>.<lang>[.gz] files")
  return paths[0], paths[1]


# --------------------------------------------------------------------------------------------------
# TensorFlow Datasets.


def _tfds_split(name: str, split: str, data_dir: str | None):
  """A sequence or iterable of `{lang: bytes or str}` examples of a TFDS split."""
  import tensorflow_datasets as tfds  # slow to import: only when a TFDS corpus is used

  try:
    try:  # random access straight from array_record files
      return tfds.data_source(
        name, split=split, data_dir=data_dir, builder_kwargs={"file_format": "array_record"}
      )
    except tfds.core.DatasetNotFoundError:
      raise
    except Exception as e:  # noqa: BLE001 - e.g. already prepared as tfrecord: read it with tf.data
      logging.info("tfds.data_source(%r) failed (%s); using tfds.load", name, e)
      return tfds.as_numpy(tfds.load(name, split=split, data_dir=data_dir, shuffle_files=False))
  except tfds.core.DatasetNotFoundError as e:
    first = str(e).splitlines()[0] if str(e) else ""
    raise ValueError(
      f"data.name {name!r} is neither 'synthetic', 'files' nor a TFDS dataset ({first})"
    ) from None


def read_tfds(
  name: str,
  split: str,
  source_lang: str,
  target_lang: str,
  data_dir: str | None = None,
  stats: SplitStats | None = None,
) -> Iterator[Pair]:
  """Pairs of a TFDS translation dataset's split, e.g. `read_tfds('wmt14_translate/de-en', 'train',
  'en', 'de')`. Examples are `{lang: text}` dicts; `source_lang`/`target_lang` pick the
  direction."""
  examples = _tfds_split(name, split, data_dir or None)

  def pairs():
    for example in examples:
      missing = [lang for lang in (source_lang, target_lang) if lang not in example]
      if missing:
        raise ValueError(
          f"TFDS dataset {name!r} has no language {missing[0]!r}; it has "
          f"{sorted(example)} (check data.source_lang / data.target_lang)"
        )
      yield tuple(
        v.decode("utf-8") if isinstance(v, bytes) else str(v)
        for v in (example[source_lang], example[target_lang])
      )

  return _clean(pairs(), stats if stats is not None else SplitStats())


# --------------------------------------------------------------------------------------------------
# The built-in synthetic task.


def synthetic_words(vocab: int) -> list[str]:
  """The synthetic task's words: `w0 ... w{vocab-1}`."""
  return [f"w{i}" for i in range(vocab)]


def _synthetic_sources(
  rng: np.random.Generator, n: int, vocab: int, min_len: int, max_len: int
) -> list[tuple[int, ...]]:
  lengths = rng.integers(min_len, max_len + 1, size=n)
  words = rng.integers(0, vocab, size=(n, max_len))
  return [tuple(row[:k].tolist()) for row, k in zip(words, lengths)]


def _synthetic_split(
  split: str, num_examples: int, vocab: int, min_len: int, max_len: int, seed: int, num_train: int
) -> list[tuple[int, ...]]:
  """Word-index sequences of a split (see `synthetic_pairs`)."""
  rng = np.random.default_rng([seed, SYNTHETIC_SPLITS.index(split) + 1])
  if split == "train":
    return _synthetic_sources(rng, num_examples, vocab, min_len, max_len)
  seen = set(_synthetic_split("train", num_train, vocab, min_len, max_len, seed, num_train))
  if split == "test":
    seen.update(
      _synthetic_split("validation", num_examples, vocab, min_len, max_len, seed, num_train)
    )
  sources = []
  while len(sources) < num_examples:  # rejection sampling: almost never rejects
    before = len(sources)
    for s in _synthetic_sources(rng, num_examples, vocab, min_len, max_len):
      if s not in seen:
        seen.add(s)
        sources.append(s)
    if len(sources) == before:
      raise ValueError(
        f"synthetic task too small for {num_examples} new {split} sentences "
        f"(synthetic_vocab={vocab}, lengths {min_len}..{max_len})"
      )
  return sources[:num_examples]


def synthetic_pairs(
  split: str,
  *,
  num_examples: int,
  vocab: int = 32,
  min_len: int = 4,
  max_len: int = 12,
  seed: int = 0,
  num_train: int = 20000,
) -> list[Pair]:
  """The synthetic task: source = `min_len..max_len` random words, target = the source reversed with
  word `w<i>` renamed `w<perm[i]>` (`perm` a fixed permutation drawn from `seed`).

  `split` is `'train'`, `'validation'` or `'test'`, each drawn from its own seed. Validation and
  test hold no duplicates and no source of the train split (`num_train` examples of the same
  seed); test holds no validation source (`num_examples` of them).
  """
  if split not in SYNTHETIC_SPLITS:
    raise ValueError(f"synthetic data has splits {SYNTHETIC_SPLITS}, not {split!r}")
  if not 1 <= min_len <= max_len:
    raise ValueError(
      f"synthetic lengths need 1 <= synthetic_min_len ({min_len}) <= synthetic_max_len ({max_len})"
    )
  perm = np.random.default_rng([seed, 0]).permutation(vocab)
  sources = _synthetic_split(split, num_examples, vocab, min_len, max_len, seed, num_train)
  return [
    (" ".join(f"w{w}" for w in s), " ".join(f"w{perm[w]}" for w in reversed(s))) for s in sources
  ]


# --------------------------------------------------------------------------------------------------
# Dispatch on config.data.name.


def _synthetic_kwargs(config_data) -> dict:
  return dict(
    num_examples=config_data.synthetic_num_train,
    vocab=config_data.synthetic_vocab,
    min_len=config_data.synthetic_min_len,
    max_len=config_data.synthetic_max_len,
    seed=config_data.get("synthetic_seed", 0),
    num_train=config_data.synthetic_num_train,
  )


def iter_split(config_data, split: str, stats: SplitStats | None = None) -> Iterator[Pair]:
  """Streams the pairs of `split` of the corpus named by `config_data.name`, counting into `stats`.

  Errors that need no reading of the text (missing files, unequal line counts, an unknown TFDS name)
  are raised before this returns.
  """
  stats = stats if stats is not None else SplitStats()
  name = config_data.name
  if name == SYNTHETIC:
    kwargs = _synthetic_kwargs(config_data)
    if split != "train":
      kwargs["num_examples"] = config_data.synthetic_num_eval
    return _clean(synthetic_pairs(split, **kwargs), stats)
  if name in (FILES, MULTI30K):
    return read_parallel_files(*parallel_files(config_data, split), stats)
  return read_tfds(
    name,
    split,
    config_data.source_lang,
    config_data.target_lang,
    config_data.tfds_data_dir or None,
    stats,
  )


def load_split(config_data, split: str) -> tuple[list[Pair], SplitStats]:
  """All `(source_text, target_text)` pairs of `split`, and the counts of kept/skipped pairs."""
  stats = SplitStats()
  pairs = list(iter_split(config_data, split, stats))
  if stats.skipped_empty:
    logging.info(
      "%s/%s: skipped %d pairs with an empty side", config_data.name, split, stats.skipped_empty
    )
  return pairs, stats


def corpus_identity(config_data, split: str) -> dict:
  """What identifies the text of `split` without reading it (names, sizes and mtimes of files);
  a change here means cached token ids of the split are stale."""
  name = config_data.name
  identity = {"name": name, "split": split}
  if name == SYNTHETIC:
    identity.update(_synthetic_kwargs(config_data), num_eval=config_data.synthetic_num_eval)
    return identity
  identity.update(source_lang=config_data.source_lang, target_lang=config_data.target_lang)
  if name == MULTI30K and not config_data.dir:
    langs = (config_data.source_lang, config_data.target_lang)
    multi30k.check(split, langs)
    identity.update(zip(("source", "target"), multi30k.identity(split, langs)))
  elif name in (FILES, MULTI30K):
    for side, path in zip(("source", "target"), parallel_files(config_data, split)):
      st = path.resolve().stat()
      identity[side] = [str(path.resolve()), st.st_size, st.st_mtime_ns]
  else:
    identity["tfds_data_dir"] = config_data.tfds_data_dir or ""
  return identity
