"""Many sentences in few batch shapes: sentences sorted by length, padded to a coarse length
bucket, and cut into batches of one row count per bucket (a partial batch is filled), so that
decoding a whole file compiles one program per bucket, a handful at most
(`inference.generator.Generator.translate_all` decodes the batches; docs/experiments.md,
"Decoding speed", has the padding cost against the compilations saved).

    batches = length_batches(token_lists, tokens_per_batch=4096)
    for batch in batches: ...   # batch.inputs [rows, length]; row j < len(batch.indices) is
                                # sentence batch.indices[j], later rows are filler
    batches = length_batches(token_lists, 4096, prefixes=prefixes)  # batch.prefixes [rows, P]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from model.special_tokens import EOS_ID, PAD_ID

MIN_BUCKET = 32


def bucket_length(n: int) -> int:
  """Padded length for a sentence of `n` tokens: the smallest of 32, 64, 128, ... that is >= n.
  Coarse on purpose: every bucket is one more compiled program (Multi30k's sentences take two),
  and padding the source costs little (the encoder and the encoder-decoder attention read it; the
  output length limits and the search's steps follow each sentence's own length)."""
  length = MIN_BUCKET
  while length < n:
    length *= 2
  return length


def round_rows(n: int) -> int:
  """The smallest of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (2^k and 3 * 2^(k-1)) that is >= n: row
  counts from a short list, so that files of similar sizes share compiled shapes."""
  rows = 1
  while rows < n:
    # A power of two 2^k (k >= 1) steps up by 3/2 to 3 * 2^(k-1), which steps up by 4/3 to
    # 2^(k+1); 1 (where rows // 3 * 4 is 0) steps to 2.
    rows = rows * 3 // 2 if rows > 1 and rows & (rows - 1) == 0 else rows // 3 * 4 or 2
  return rows


def prefix_width(prefixes: Sequence[Sequence[int]]) -> int:
  """The width P of a set of target prefixes as the searches take them ([rows, P], tokens then
  PAD): `bucket_length` of the longest + 1, so every row ends in PAD and files share shapes."""
  return bucket_length(max((len(p) for p in prefixes), default=0) + 1)


def padded(rows: Sequence[Sequence[int]], width: int) -> np.ndarray:
  """[len(rows), width] int32: each row's ids, then PAD (0)."""
  out = np.zeros((len(rows), width), np.int32)
  for i, row in enumerate(rows):
    out[i, : len(row)] = row
  return out


def checked_prefixes(prefix, rows: int, limit: int) -> np.ndarray:
  """`prefix` as int32 [rows, P]: each row a target prefix's ids (above EOS, below `limit`) then
  PAD, at least one PAD at the end; ValueError naming the first row or id that is not."""
  prefix = np.asarray(prefix)
  if prefix.ndim != 2 or prefix.shape[0] != rows or not np.issubdtype(prefix.dtype, np.integer):
    raise ValueError(
      f"prefix: must be [batch={rows}, P] integer ids, got {prefix.dtype} {list(prefix.shape)}"
    )
  present = prefix != PAD_ID
  bad = present & ((prefix <= EOS_ID) | (prefix >= limit))
  if bad.any():
    row, col = np.argwhere(bad)[0]
    raise ValueError(
      f"prefix[{row}, {col}]={prefix[row, col]}: a prefix token must be above EOS ({EOS_ID}) "
      f"and below {limit}"
    )
  wrong = (present[:, 1:] & ~present[:, :-1]).any(axis=1) | present[:, -1]
  if wrong.any():
    raise ValueError(
      f"prefix[{int(np.argmax(wrong))}]: must be tokens then PAD, at least one PAD at the end "
      f"(P={prefix.shape[1]} must exceed the longest prefix)"
    )
  return prefix.astype(np.int32)


class LengthBatch(NamedTuple):
  """One batch of `length_batches`: `inputs` [rows, length] padded ids; row j < len(indices) is
  sentence `indices[j]`, later rows repeat the last real row (filler); `prefixes` [rows, P] the
  rows' target prefixes when given (None otherwise)."""

  indices: np.ndarray
  inputs: np.ndarray
  prefixes: np.ndarray | None = None


def length_batches(
  token_lists: Sequence[Sequence[int]],
  tokens_per_batch: int,
  batch_multiple: int = 1,
  prefixes: Sequence[Sequence[int]] | None = None,
  max_rows: int | None = None,
) -> list[LengthBatch]:
  """Groups sentences of similar length into padded batches, one shape per length bucket.

  Sentences are sorted by length and padded to `bucket_length`. A bucket's sentences are cut into
  as few batches as hold at most `tokens_per_batch // length` rows each, and at most `max_rows`
  (at least `batch_multiple`); all of them get the same row count: the bucket's sentences spread
  over them, rounded up by `round_rows` and to a multiple of `batch_multiple` (never above that
  limit). The last batch's spare rows repeat its last sentence, so they stop when it does.
  `prefixes` (one per sentence) go with their sentences, all `prefix_width` wide.

  Returns:
    the batches; concatenating their `indices` gives every sentence index once.
  """
  if tokens_per_batch < 1 or batch_multiple < 1 or (max_rows is not None and max_rows < 1):
    raise ValueError(
      f"length_batches: tokens_per_batch ({tokens_per_batch}), batch_multiple "
      f"({batch_multiple}) and max_rows ({max_rows}) must be positive"
    )
  if prefixes is not None and len(prefixes) != len(token_lists):
    raise ValueError(f"length_batches: {len(prefixes)} prefixes for {len(token_lists)} sentences")
  width = None if prefixes is None else prefix_width(prefixes)
  lengths = np.array([len(t) for t in token_lists], np.int64)
  order = np.argsort(lengths, kind="stable")
  buckets = np.array([bucket_length(n) for n in lengths[order]], np.int64)
  batches = []
  for length in np.unique(buckets):
    members = order[buckets == length]
    limit = min(tokens_per_batch // length, max_rows or tokens_per_batch)
    limit = max(batch_multiple, limit // batch_multiple * batch_multiple)
    count = -(-len(members) // limit)
    groups = round_rows(-(-len(members) // (count * batch_multiple)))
    rows = min(limit, groups * batch_multiple)
    for start in range(0, len(members), rows):
      indices = members[start : start + rows]
      fill = list(indices) + [indices[-1]] * (rows - len(indices))
      ids = padded([token_lists[i] for i in fill], int(length))
      pre = None if prefixes is None else padded([prefixes[i] for i in fill], width)
      batches.append(LengthBatch(indices, ids, pre))
  return batches
