"""Token-budget batches of cached token ids: packing or length bucketing, per-process shards,
resumable.

A batch is a dict of int32 numpy arrays, all `[rows, length]`:

* `inputs`, `targets`: token ids, 0 on padding; every sentence ends with EOS_ID.
* `inputs_segmentation`, `targets_segmentation`: 1, 2, 3, ... for the examples packed in a row, 0 on
  padding (an unpacked row is 1 on its tokens). Source and target of one example share the number.
* `inputs_position`, `targets_position`: position of a token inside its own example, 0 on padding.

Every batch has all six keys. Rows per batch come from a budget of padded target tokens per *global*
batch (all processes together): `rows = tokens_per_batch // length`, rounded down to a multiple of
`lcm(batch_multiple, process_count)` but never below it.

* `packing=True`: examples are packed first-fit into rows of `max_len` (an example joins a
  row only if both its source and its target fit); one shape, one compilation.
* `packing=False`: examples are bucketed by `max(source, target)` length into lengths 8, 16, ...,
  `max_len`; each bucket has its own row count. `batch_shapes` lists the shapes that can occur.

Every process builds the same plan of global batches from the lengths alone (cheap index arithmetic)
and materialises only its contiguous block of rows `[p * R / P, (p + 1) * R / P)`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections.abc import Iterator

import numpy as np
from absl import logging

from data.token_cache import TokenizedSplit

FEATURES = (
  "inputs",
  "targets",
  "inputs_segmentation",
  "targets_segmentation",
  "inputs_position",
  "targets_position",
)
BUCKET_STEP = 8
OPEN_ROWS = 8  # rows kept open for first-fit packing


def rows_per_batch(tokens_per_batch: int, length: int, multiple: int) -> int:
  """`tokens_per_batch // length` rounded down to a multiple of `multiple`, at least `multiple`."""
  return max(multiple, tokens_per_batch // length // multiple * multiple)


def bucket_lengths(max_len: int, step: int = BUCKET_STEP) -> list[int]:
  """Bucket lengths: multiples of `step` below `max_len`, then `max_len`."""
  return [*range(step, max_len, step), max_len]


@dataclasses.dataclass(frozen=True)
class BatchPlan:
  """Which examples go where in one global batch of `[num_rows, length]`.

  `examples[j]` (an example id) is placed in row `rows[j]`; `rows` is non-decreasing, and examples
  of one row appear in their order inside the row.
  """

  examples: np.ndarray
  rows: np.ndarray
  num_rows: int
  length: int


def pack_rows(
  source_lengths: np.ndarray, target_lengths: np.ndarray, length: int, open_rows: int = OPEN_ROWS
) -> np.ndarray:
  """Row index of each example, packing them in the given order into rows of `length` tokens.

  First-fit over the last `open_rows` rows that still have room: an example goes into the first open
  row where both its source and its target fit, else it opens a new row (closing the oldest one).
  Returns `[num_examples]` int64 row indices (0, 1, ...).
  """
  row_of = np.empty(len(source_lengths), np.int64)
  free_src, free_tgt, ids = [], [], []
  new_row = 0
  for i, (s, t) in enumerate(zip(source_lengths.tolist(), target_lengths.tolist())):
    for j in range(len(ids)):
      if s <= free_src[j] and t <= free_tgt[j]:
        free_src[j] -= s
        free_tgt[j] -= t
        row_of[i] = ids[j]
        if free_src[j] < 2 or free_tgt[j] < 2:  # nothing fits any more (an example is >= 2)
          del free_src[j], free_tgt[j], ids[j]
        break
    else:
      if len(ids) == open_rows:
        del free_src[0], free_tgt[0], ids[0]
      free_src.append(length - s)
      free_tgt.append(length - t)
      ids.append(new_row)
      row_of[i] = new_row
      new_row += 1
  return row_of


def _split_rows(
  examples: np.ndarray, rows: np.ndarray, num_rows: int, length: int
) -> list[BatchPlan]:
  """Cuts examples placed in rows 0, 1, ... (`rows` non-decreasing) into batches of `num_rows` rows;
  the last batch keeps its shape with empty rows."""
  total_rows = int(rows[-1]) + 1 if len(rows) else 0
  cuts = np.searchsorted(rows, np.arange(0, total_rows + num_rows, num_rows))
  return [
    BatchPlan(examples[a:b], rows[a:b] - k * num_rows, num_rows, length)
    for k, (a, b) in enumerate(zip(cuts[:-1], cuts[1:]))
    if b > a
  ]


def _fill(
  tokens: np.ndarray,
  offsets: np.ndarray,
  examples: np.ndarray,
  rows: np.ndarray,
  num_rows: int,
  length: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Token, segmentation and position arrays `[num_rows, length]` for one side (vectorised)."""
  out = [np.zeros(num_rows * length, np.int32) for _ in range(3)]
  if len(examples):
    starts = offsets[examples]
    lengths = offsets[examples + 1] - starts
    ends = np.cumsum(lengths)
    begins = ends - lengths  # where each example starts in their concatenation
    idx = np.arange(len(examples))
    first = np.ones(len(examples), bool)  # first example of its row
    first[1:] = rows[1:] != rows[:-1]
    first_of_row = np.maximum.accumulate(np.where(first, idx, 0))
    columns = begins - begins[first_of_row]
    within = np.arange(ends[-1]) - np.repeat(begins, lengths)
    where = np.repeat(rows * length + columns, lengths) + within
    out[0][where] = tokens[np.repeat(starts, lengths) + within]
    out[1][where] = np.repeat(idx - first_of_row + 1, lengths)
    out[2][where] = within
  return tuple(a.reshape(num_rows, length) for a in out)


class Batcher:
  """Plans and materialises the batches of one tokenized split for one process.

  Args:
    data: the split's cached token ids; sequences at most `max_len` long, EOS included.
    tokens_per_batch: budget of padded target tokens per global batch (all processes).
    max_len: row length when packing; the longest bucket otherwise.
    packing: pack examples into rows (True) or bucket them by length (False).
    batch_multiple: the GLOBAL row multiple: data-parallel devices over all processes x
      gradient-accumulation micro-batches. Global row counts are multiples of
      `lcm(batch_multiple, process_count)`.
    process_index, process_count: this process and the number of processes.
    seed: training order; epoch `e` is shuffled by a generator seeded with `(seed, e)`.
  """

  def __init__(
    self,
    data: TokenizedSplit,
    *,
    tokens_per_batch: int,
    max_len: int,
    packing: bool,
    batch_multiple: int = 1,
    process_index: int = 0,
    process_count: int = 1,
    seed: int = 0,
  ):
    if not 0 <= process_index < process_count:
      raise ValueError(f"process_index {process_index} not in [0, process_count={process_count})")
    if batch_multiple < 1 or tokens_per_batch < 1:
      raise ValueError(
        f"batch_multiple ({batch_multiple}) and data.tokens_per_batch "
        f"({tokens_per_batch}) must be positive"
      )
    self.data, self.max_len, self.packing, self.seed = data, max_len, packing, seed
    self.tokens_per_batch = tokens_per_batch
    self.process_index, self.process_count = process_index, process_count
    self.multiple = math.lcm(batch_multiple, process_count)
    if self.multiple * max_len > tokens_per_batch:
      logging.warning(
        "data.tokens_per_batch=%d is below one row of %d tokens per batch multiple "
        "(%d): batches hold %d tokens",
        tokens_per_batch,
        max_len,
        self.multiple,
        self.multiple * max_len,
      )
    self._lengths = np.maximum(data.source_lengths, data.target_lengths)
    if len(self._lengths) and self._lengths.max() > max_len:
      raise ValueError(
        f"{data.path} holds sequences of {self._lengths.max()} tokens, more than max_len={max_len}"
      )

  @functools.cached_property
  def _corpus_key(self) -> str:
    """The split's example lengths, hashed: all the plans read of the corpus (its cache
    folder's name would change with the data files' paths and times)."""
    digest = hashlib.sha256(np.asarray(self.data.source_lengths, np.int64).tobytes())
    digest.update(np.asarray(self.data.target_lengths, np.int64).tobytes())
    return digest.hexdigest()[:16]

  @property
  def plan_signature(self) -> dict:
    """What the epoch plans depend on: with all of it equal, a saved position (epoch, index)
    names the same batch again."""
    return {
      "corpus": self._corpus_key,
      "examples": int(self.data.num_examples),
      "seed": int(self.seed),
      "tokens_per_batch": int(self.tokens_per_batch),
      "max_len": int(self.max_len),
      "packing": bool(self.packing),
      "row_multiple": int(self.multiple),
    }

  def _rows(self, length: int) -> int:
    return rows_per_batch(self.tokens_per_batch, length, self.multiple)

  @property
  def batch_shapes(self) -> list[tuple[int, int]]:
    """The `(rows, length)` shapes of the training batches this process receives."""
    if self.packing:
      lengths = [self.max_len]
    else:
      buckets = bucket_lengths(self.max_len)
      used = np.unique(np.searchsorted(buckets, self._lengths))
      lengths = [buckets[b] for b in used]
    return [(self._rows(n) // self.process_count, n) for n in lengths]

  def epoch_plan(self, epoch: int) -> list[BatchPlan]:
    """The global batches of training epoch `epoch`, in order; every example appears once."""
    rng = np.random.default_rng([self.seed, epoch])
    order = rng.permutation(self.data.num_examples)
    if self.packing:
      return self._packed(order)
    buckets = bucket_lengths(self.max_len)
    bucket = np.searchsorted(buckets, self._lengths[order])
    by_bucket = np.argsort(bucket, kind="stable")
    order = order[by_bucket]  # grouped by bucket, shuffled inside each
    bounds = np.searchsorted(bucket[by_bucket], np.arange(len(buckets) + 1))
    plans = []
    for b, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
      members = order[lo:hi]
      plans += _split_rows(members, np.arange(len(members)), self._rows(buckets[b]), buckets[b])
    return [plans[i] for i in rng.permutation(len(plans))]

  def _packed(self, order: np.ndarray) -> list[BatchPlan]:
    rows = pack_rows(self.data.source_lengths[order], self.data.target_lengths[order], self.max_len)
    by_row = np.argsort(rows, kind="stable")
    return _split_rows(order[by_row], rows[by_row], self._rows(self.max_len), self.max_len)

  def eval_plan(self) -> list[BatchPlan]:
    """Batches over every example once, in corpus order, all of one shape `[rows, max_len]`:
    packed when `packing`, else one example per row."""
    order = np.arange(self.data.num_examples)
    if self.packing:
      return self._packed(order)
    return _split_rows(order, order, self._rows(self.max_len), self.max_len)

  def materialize(self, plan: BatchPlan) -> dict[str, np.ndarray]:
    """This process's rows of a global batch: arrays
    `[plan.num_rows / process_count, plan.length]`."""
    local = plan.num_rows // self.process_count
    first = self.process_index * local
    lo, hi = np.searchsorted(plan.rows, [first, first + local])
    examples, rows = plan.examples[lo:hi], plan.rows[lo:hi] - first
    batch = {}
    for side, prefix in (("source", "inputs"), ("target", "targets")):
      tokens, offsets = getattr(self.data, f"{side}_tokens"), getattr(self.data, f"{side}_offsets")
      (batch[prefix], batch[f"{prefix}_segmentation"], batch[f"{prefix}_position"]) = _fill(
        tokens, offsets, examples, rows, local, plan.length
      )
    return batch

  def train_iter(self) -> TrainIterator:
    """Endless training batches from epoch 0; see `TrainIterator`."""
    if not self.data.num_examples:
      raise ValueError(f"no training examples in {self.data.path} (stats: {self.data.stats})")
    return TrainIterator(self)

  def eval_batches(self) -> Iterator[dict[str, np.ndarray]]:
    """Finite iterator over `eval_plan()`'s batches for this process."""
    return (self.materialize(plan) for plan in self.eval_plan())


class TrainIterator:
  """Endless training batches, epoch after epoch, with a resumable position.

  `state()` is a small JSON-able dict naming the next batch (`epoch`, `index`) and what the plan
  depends on (`plan`: `Batcher.plan_signature`, `batches` in the epoch); after `restore(state)` —
  in this or a freshly built pipeline with the same data, config, seed, `batch_multiple` and
  process count — the iterator yields exactly the batches that would have come next. When the
  plan changed (another device count, batch budget, seed or corpus), `restore` warns with what
  changed and continues the epoch at the same fraction of its batches: exact order is then lost
  for that epoch only. Each epoch's plan is recomputed from the lengths when the epoch starts.
  """

  def __init__(self, batcher: Batcher):
    self._batcher = batcher
    self._epoch, self._index = 0, 0
    self._plan_epoch, self._plan = None, []

  def __iter__(self) -> TrainIterator:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    while self._index >= len(self._epoch_plan(self._epoch)):
      self._epoch, self._index = self._epoch + 1, 0
    batch = self._batcher.materialize(self._plan[self._index])
    self._index += 1
    return batch

  @property
  def epoch(self) -> int:
    return self._epoch

  def _epoch_plan(self, epoch: int) -> list[BatchPlan]:
    if self._plan_epoch != epoch:
      self._plan, self._plan_epoch = self._batcher.epoch_plan(epoch), epoch
    return self._plan

  def state(self) -> dict:
    """Position of the next batch, and what the epoch's plan depends on."""
    return {
      "epoch": self._epoch,
      "index": self._index,
      "batches": len(self._epoch_plan(self._epoch)),
      "plan": self._batcher.plan_signature,
    }

  def restore(self, state: dict) -> None:
    """Continues from a position returned by `state()` (see the class doc when the plan
    changed; states without `plan`, from older checkpoints, are taken as they are)."""
    try:
      epoch, index = int(state["epoch"]), int(state["index"])
    except (KeyError, TypeError, ValueError) as e:
      raise ValueError(
        f"bad data iterator state {state!r}: expected {{'epoch': int, 'index': int}}"
      ) from e
    if epoch < 0 or index < 0:
      raise ValueError(f"bad data iterator state {state!r}: negative position")
    saved, current = state.get("plan"), self._batcher.plan_signature
    if saved is not None and saved != current:
      changed = "; ".join(
        f"{k}: {saved.get(k)!r} -> {current.get(k)!r}"
        for k in sorted(set(saved) | set(current))
        if saved.get(k) != current.get(k)
      )
      old_batches, new_batches = state.get("batches"), len(self._epoch_plan(epoch))
      mapped = min(new_batches, round(index * new_batches / old_batches)) if old_batches else 0
      logging.warning(
        "the training data's batch plan changed since the checkpoint (%s): epoch %d "
        "continues at batch %d of %d, the fraction the checkpoint reached (%d of %s); "
        "examples near that point may be repeated or skipped in this epoch only",
        changed,
        epoch,
        mapped,
        new_batches,
        index,
        old_batches,
      )
      index = mapped
    self._epoch, self._index = epoch, index
