"""Token-id cache: each split is tokenized once and kept as memory-mapped arrays on disk.

A cache entry is a folder `<cache_dir>/<split>-<key>/` whose key hashes the corpus identity (names,
file sizes and mtimes), the vocabulary fingerprint, `max_len` and `truncate`, so a changed corpus or
vocabulary gets a new entry. It is built in a temporary folder and renamed into place: a crash never
leaves a half-written entry, and later epochs and resumed runs only read it.

Each sequence is stored with EOS appended and is at most `max_len` tokens long: longer examples are
dropped (default) or cut to `max_len - 1` tokens + EOS (`truncate=True`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import os
import pathlib
import re
import shutil
import uuid
from collections.abc import Callable, Iterable

import numpy as np
from absl import logging

from data.sources import Pair, SplitStats
from data.tokenizer import Vocab
from model.special_tokens import EOS_ID

CACHE_FORMAT = 1
_SIDES = ("source", "target")
_CHUNK = 8192  # pairs tokenized at a time


@dataclasses.dataclass
class TokenizedSplit:
  """Token ids of one split, memory-mapped.

  Example `i`'s source is `source_tokens[source_offsets[i]:source_offsets[i + 1]]` (int32, ending
  with EOS_ID); the same for the target.
  Attributes:
    source_tokens, target_tokens: `[total_tokens]` int32.
    source_offsets, target_offsets: `[num_examples + 1]` int64.
    stats: counts: `pairs` read, `skipped_empty`, `filtered_long`, `truncated_long`, `examples`
      kept, `source_tokens`, `target_tokens`.
    path: the cache folder.
    built: True when this call tokenized the text, False when it was read from the cache.
  """

  source_tokens: np.ndarray
  source_offsets: np.ndarray
  target_tokens: np.ndarray
  target_offsets: np.ndarray
  stats: dict
  path: pathlib.Path
  built: bool

  @property
  def num_examples(self) -> int:
    return len(self.source_offsets) - 1

  @functools.cached_property
  def source_lengths(self) -> np.ndarray:
    """`[num_examples]` int64 source lengths, EOS included."""
    return np.diff(self.source_offsets)

  @functools.cached_property
  def target_lengths(self) -> np.ndarray:
    """`[num_examples]` int64 target lengths, EOS included."""
    return np.diff(self.target_offsets)


def cache_key(identity: dict, vocab_fingerprint: str, max_len: int, truncate: bool) -> str:
  """A short hash of everything the cached ids depend on."""
  spec = json.dumps(
    {
      "format": CACHE_FORMAT,
      "corpus": identity,
      "vocab": vocab_fingerprint,
      "max_len": max_len,
      "truncate": bool(truncate),
    },
    sort_keys=True,
  )
  return hashlib.sha256(spec.encode("utf-8")).hexdigest()[:16]


def _with_eos(ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
  """Flat int32 tokens of `ids` with EOS after each sequence, and the lengths (EOS included)."""
  lengths = np.fromiter(map(len, ids), np.int64, len(ids)) + 1
  flat = np.empty(int(lengths.sum()), np.int32)
  eos = np.cumsum(lengths) - 1
  body = np.ones(len(flat), bool)
  body[eos] = False
  flat[body] = np.fromiter(itertools.chain.from_iterable(ids), np.int32, len(flat) - len(ids))
  flat[eos] = EOS_ID
  return flat, lengths


def _tokenize(
  pairs: Iterable[Pair], vocab: Vocab, max_len: int, truncate: bool, folder: pathlib.Path
) -> dict:
  """Writes `<side>.bin` (raw int32) and `<side>_offsets.npy` into `folder`; returns the counts."""
  counts = {"filtered_long": 0, "truncated_long": 0, "examples": 0}
  lengths = {side: [] for side in _SIDES}
  files = {side: open(folder / f"{side}.bin", "wb") for side in _SIDES}
  try:
    pairs = iter(pairs)
    while chunk := list(itertools.islice(pairs, _CHUNK)):
      ids = {
        "source": vocab.encode_batch([p[0] for p in chunk]),
        "target": vocab.encode_target_batch([p[1] for p in chunk]),
      }
      too_long = [
        i
        for i in range(len(chunk))
        if len(ids["source"][i]) >= max_len or len(ids["target"][i]) >= max_len
      ]
      if truncate:
        counts["truncated_long"] += len(too_long)
        for side in _SIDES:
          for i in too_long:
            ids[side][i] = ids[side][i][: max_len - 1]
      elif too_long:
        counts["filtered_long"] += len(too_long)
        drop = set(too_long)
        for side in _SIDES:
          ids[side] = [x for i, x in enumerate(ids[side]) if i not in drop]
      counts["examples"] += len(ids["source"])
      for side in _SIDES:
        flat, n = _with_eos(ids[side])
        files[side].write(flat.astype("<i4", copy=False).tobytes())
        lengths[side].append(n)
  finally:
    for f in files.values():
      f.close()
  for side in _SIDES:
    n = np.concatenate(lengths[side]) if lengths[side] else np.zeros(0, np.int64)
    np.save(folder / f"{side}_offsets.npy", np.concatenate([[0], np.cumsum(n)]).astype(np.int64))
    counts[f"{side}_tokens"] = int(n.sum())
  return counts


def _open(folder: pathlib.Path, built: bool) -> TokenizedSplit:
  meta = json.loads((folder / "meta.json").read_text())
  arrays = {}
  for side in _SIDES:
    offsets = np.load(folder / f"{side}_offsets.npy", mmap_mode="r")
    if offsets[-1]:
      tokens = np.memmap(folder / f"{side}.bin", dtype="<i4", mode="r", shape=(int(offsets[-1]),))
    else:  # an empty file cannot be memory-mapped
      tokens = np.zeros(0, np.int32)
    arrays[f"{side}_tokens"], arrays[f"{side}_offsets"] = tokens, offsets
  return TokenizedSplit(**arrays, stats=meta["stats"], path=folder, built=built)


def load_or_tokenize(
  cache_dir: str | os.PathLike,
  name: str,
  identity: dict,
  vocab: Vocab,
  pairs_fn: Callable[[SplitStats], Iterable[Pair]],
  *,
  max_len: int,
  truncate: bool = False,
) -> TokenizedSplit:
  """The token ids of one split, from the cache when present, else tokenized and cached.

  Args:
    cache_dir: folder holding cache entries.
    name: readable prefix of the entry's folder name (the split name).
    identity: what identifies the text (see `sources.corpus_identity`); part of the key.
    vocab: the vocabulary; its fingerprint is part of the key.
    pairs_fn: called only on a cache miss; returns the `(source, target)` pairs and counts read and
      skipped pairs into the `SplitStats` it is given.
    max_len: longest sequence kept, in tokens, EOS included.
    truncate: cut longer examples instead of dropping them.
  """
  if max_len < 2:
    raise ValueError(f"data.max_len must be at least 2 (one token + EOS), got {max_len}")
  cache_dir = pathlib.Path(cache_dir)
  # A split name may hold '/' or other characters a folder name cannot (e.g. 'dev/news2013').
  safe = re.sub(r"[^\w.-]", "_", name)
  folder = cache_dir / f"{safe}-{cache_key(identity, vocab.fingerprint, max_len, truncate)}"
  if (folder / "meta.json").is_file():
    return _open(folder, built=False)

  cache_dir.mkdir(parents=True, exist_ok=True)
  # A name of its own per writer; unlike tempfile.mkdtemp's 0700, the folder follows the umask.
  tmp = cache_dir / f".{folder.name}.{uuid.uuid4().hex}.tmp"
  try:
    tmp.mkdir()
    split_stats = SplitStats()
    counts = _tokenize(pairs_fn(split_stats), vocab, max_len, truncate, tmp)
    stats = {"pairs": split_stats.pairs, "skipped_empty": split_stats.skipped_empty, **counts}
    meta = {
      "format": CACHE_FORMAT,
      "corpus": identity,
      "vocab": vocab.fingerprint,
      "max_len": max_len,
      "truncate": bool(truncate),
      "stats": stats,
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    try:
      os.rename(tmp, folder)
    except OSError:
      if not (folder / "meta.json").is_file():  # not a concurrent writer finishing first
        raise
      shutil.rmtree(tmp)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  logging.info("Cached token ids of %s in %s: %s", name, folder, stats)
  return _open(folder, built=True)
