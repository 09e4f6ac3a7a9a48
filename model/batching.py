"""Many sentences in few batch shapes: sentences sorted by length, padded to a coarse length
bucket, and cut into batches of one row count per bucket (a partial batch is filled), so that
decoding a whole file compiles one program per bucket, a handful at most
(`inference.generator.Generator.translate_all` decodes the batches; docs/experiments.md,
"Decoding speed", has the padding cost against the compilations saved).

    batches = length_batches(token_lists, tokens_per_batch=4096)
    for batch in batches: ...   # batch.inputs [rows, length]; row j < len(batch.indices) is
                                # sentence batch.indices[j], later rows are filler
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

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


class LengthBatch(NamedTuple):
  """One batch of `length_batches`: `inputs` [rows, length] padded ids; row j < len(indices) is
  sentence `indices[j]`, later rows repeat the last real row (filler)."""

  indices: np.ndarray
  inputs: np.ndarray


def length_batches(
  token_lists: Sequence[Sequence[int]], tokens_per_batch: int, batch_multiple: int = 1
) -> list[LengthBatch]:
  """Groups sentences of similar length into padded batches, one shape per length bucket.

  Sentences are sorted by length and padded to `bucket_length`. A bucket's sentences are cut into
  as few batches as hold at most `tokens_per_batch // length` rows each (at least
  `batch_multiple`); all of them get the same row count: the bucket's sentences spread over them,
  rounded up by `round_rows` and to a multiple of `batch_multiple` (never above that limit). The
  last batch's spare rows repeat its last sentence, so they stop when it does.

  Returns:
    the batches; concatenating their `indices` gives every sentence index once.
  """
  if tokens_per_batch < 1 or batch_multiple < 1:
    raise ValueError(
      f"length_batches: tokens_per_batch ({tokens_per_batch}) and batch_multiple "
      f"({batch_multiple}) must be positive"
    )
  lengths = np.array([len(t) for t in token_lists], np.int64)
  order = np.argsort(lengths, kind="stable")
  buckets = np.array([bucket_length(n) for n in lengths[order]], np.int64)
  batches = []
  for length in np.unique(buckets):
    members = order[buckets == length]
    limit = max(batch_multiple, tokens_per_batch // length // batch_multiple * batch_multiple)
    count = -(-len(members) // limit)
    groups = round_rows(-(-len(members) // (count * batch_multiple)))
    rows = min(limit, groups * batch_multiple)
    for start in range(0, len(members), rows):
      indices = members[start : start + rows]
      ids = np.zeros((rows, int(length)), np.int32)
      for row, i in enumerate(indices):
        ids[row, : lengths[i]] = token_lists[i]
      ids[len(indices) :] = ids[len(indices) - 1]
      batches.append(LengthBatch(indices, ids))
  return batches
