"""`Generator.translate_all`'s beam search with the sentences still searching merged across
batches: each length batch is searched in pieces (model/beam_pieces.py) paused at the cache's
segment ends past a quarter of its source width and up to it (steps 16 and 32 for a width of 32,
32 and 64 for 64: `piece_stops`); at a pause its finished sentences are taken, and the entries
still searching in batches that have finished ones wait until a whole piece of them (same shape,
same step) can go on together. A batch no longer steps all its rows until its last sentence is
done: the rows a finished sentence would fill are searched for another.

After its first pause a batch's entries go on in batches of at most `LATER_BATCH` sentences and
`LATER_TOKENS` source tokens, whatever the batch they began in: a bigger batch steps more rows
for its last straggler, and long sentences' caches outgrow the CPU's caches, so a big first batch
(the rows its products want) does not make the later stages slower. On a CPU the first pieces
take that size too (`first_batch_limits`): there a bigger first piece steps more rows for its
stragglers than its fewer product calls save, so a bigger `tokens_per_batch` searches exactly as
the default. Within a piece after the first pause (and a search in one piece), the steps run
over the chunks of sentences still searching (model/live_chunks.py), so a straggler no longer
steps its whole piece's rows either. A sentence gets its own batch's search; where its steps ran
over fewer rows than its batch's (a chunk, a smaller later piece), XLA:CPU's products may round
its scores differently in the last bits (docs/experiments.md).

Streaming, not batch by batch: `parallel_batches` pieces run at any time and one more waits for
the first thread to be free (each piece ends in host work before the next is chosen); a freed
place goes to a full group of waiting entries (the latest pause first), else to the next batch;
once every batch has begun, a group that no piece in flight can add to goes on as it is, its
spare rows a copy of its last entry marked done (`beam_pieces.spare`: the steps over the
sentences still searching leave them out). A waiting entry is a host copy of its own rows only. One
piece at a time (`parallel_batches` 1), the pieces are taken in the order they began, so every
run groups the same entries (the rows searched are the same); with more, in the order they end.
"""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Callable

import jax
import numpy as np

from model import beam_pieces, search

# A shape whose sentences fill fewer later pieces (`later_shape`) is searched whole, in one loop
# (inference/generator.py): merging so few would save less than its pieces' programs, about four
# times the whole search's, cost to compile and read back (docs/experiments.md).
MIN_PIECES = 8
# A batch pauses only past this fraction of its source width (`piece_stops`): outputs seldom end
# sooner, so an earlier pause merges few entries for a program more (docs/experiments.md).
PAUSE_FROM = 1 / 4
# What a piece after the first pause holds at most: sentences, and source tokens (padded) in all
# (docs/experiments.md, "Later stages in smaller batches").
LATER_BATCH = 16
LATER_TOKENS = 512


def piece_stops(shape: tuple, max_len: int, segment: int | None, sentences: int) -> list[int]:
  """Where the pieces of the batches of `shape` (inputs [sentences, src_len]) holding
  `sentences` sentences in all, searched to output width `max_len` (a cache growing from
  `segment` positions), pause, then `max_len`: at the cache's segment ends past `PAUSE_FROM`
  (a quarter) of `src_len`, the padded source length, and up to it. Outputs seldom end before a
  quarter of their bucket's width (its sources are longer than half of it, but for the
  narrowest) nor after it, so a pause outside that range would merge few entries, for a program
  more to compile and read back (the last piece runs one loop to `max_len`,
  `search.segmented_loop`). In one piece when the sentences fill fewer than `MIN_PIECES` later
  pieces (whatever batches they were cut into)."""
  if math.ceil(sentences / later_shape(shape)[0]) < MIN_PIECES:
    return [max_len]
  width = shape[1]
  pauses = search.pause_steps(max_len, segment)
  return [p for p in pauses if width * PAUSE_FROM < p <= width] + [max_len]


def whole_batches_recut(batches: list, max_extra_len: int, segment: int | None) -> list:
  """`batches` (`LengthBatch`es in `length_batches`' order, no prefixes) with those of each
  shape searched in one piece (`piece_stops`) cut again into batches of `later_shape`'s
  sentences, the last one's spare rows repeating its last sentence: a search in one piece has no
  later pieces to merge its stragglers into, so its batches take the later pieces' size,
  whatever size they were cut to (bigger batches no slower)."""
  shapes: dict[tuple, list] = {}
  for b in batches:
    shapes.setdefault(b.inputs.shape, []).append(b)
  out = []
  for shape, group in shapes.items():
    rows, max_len = later_shape(shape)[0], shape[1] + max_extra_len
    sentences = sum(len(b.indices) for b in group)
    if rows == shape[0] or piece_stops(shape, max_len, segment, sentences) != [max_len]:
      out += group
      continue
    indices = np.concatenate([b.indices for b in group])
    inputs = np.concatenate([np.asarray(b.inputs)[: len(b.indices)] for b in group])
    for start in range(0, len(indices), rows):
      x = inputs[start : start + rows]
      x = np.concatenate([x, np.repeat(x[-1:], rows - len(x), axis=0)])
      out.append(group[0]._replace(indices=indices[start : start + rows], inputs=x))
  return out


def later_shape(shape: tuple) -> tuple:
  """The inputs' shape [sentences, src_len] of the pieces a batch of `shape` goes on in after
  its first pause: at most `LATER_BATCH` sentences and `LATER_TOKENS` source tokens (at least
  one sentence)."""
  return (max(1, min(shape[0], LATER_BATCH, LATER_TOKENS // shape[1])), shape[1])


def first_batch_limits(tokens_per_batch: int) -> tuple[int, int]:
  """(source tokens, sentences) a batch holds at most when its first piece takes the later
  pieces' size (`Generator`'s `cut_first`, on a CPU by default): `tokens_per_batch` capped at
  `LATER_TOKENS`, and `LATER_BATCH` sentences."""
  return min(tokens_per_batch, LATER_TOKENS), LATER_BATCH


def piece_programs(shape: tuple, stops: list[int]) -> list[tuple]:
  """(inputs' shape, start, until) of each piece a batch of `shape` paused at `stops` is searched
  in: the first at the batch's own shape, the later ones at `later_shape`'s."""
  ends = [0, *stops]
  return [(shape if a == 0 else later_shape(shape), a, b) for a, b in zip(ends, ends[1:])]


def merged_translate(
  run: Callable,
  batches: list,
  stops_of: Callable[[tuple], list[int]],
  beam: int,
  parallel_batches: int,
  finish: Callable[[int, object, int], None],
) -> tuple[int, int]:
  """Searches `batches` (`LengthBatch`es, inputs as the programs take them) in pieces.

  Args:
    run: `run(shape, x, start, until)` -> (piece, outputs, done [rows] bool, computed,
      searched [rows]) as numpy (the piece as the program returned it; `computed` the steps
      its entries were computed, summed): `x` a batch of inputs of `shape` (start 0) or a
      piece of `shape[0]` entries paused at `start` (shape `later_shape` of their batch's),
      searched to `until`.
    stops_of: a batch shape's pause steps, then its output width (where every search ends);
      its entries keep them in the later pieces.
    beam: rows per sentence.
    finish: `finish(sentence, outputs, row)` for each sentence once done (any order).

  Returns:
    (rows x steps searched, rows x steps the sentences needed).
  """
  todo = list(range(len(batches)))[::-1]  # batches not begun, next last
  waiting: dict[tuple, list] = {}  # (shape, stops, stage) -> [(one-entry piece, sentence)]
  inflight: dict[concurrent.futures.Future, tuple] = {}  # -> (shape, stops, stage, owners)
  computed = needed = 0
  pool = concurrent.futures.ThreadPoolExecutor(parallel_batches)
  queued = parallel_batches + 1  # a thread done with a piece finds the next one waiting

  def can_grow(shape, stops, stage) -> bool:  # once every batch has begun
    return any(
      later_shape(s) == shape and e == stops and g < stage for s, e, g, _ in inflight.values()
    )

  def submit(x, shape, stops, stage, owners):
    start = 0 if stage == 0 else stops[stage - 1]
    inflight[pool.submit(run, shape, x, start, stops[stage])] = (shape, stops, stage, owners)

  def next_work() -> bool:
    full = [k for k, v in waiting.items() if len(v) >= k[0][0]]
    if full:
      key = max(full, key=lambda k: k[2])
    elif todo:
      n = todo.pop()
      shape = batches[n].inputs.shape
      owners = list(batches[n].indices) + [None] * (shape[0] - len(batches[n].indices))
      submit(batches[n].inputs, shape, tuple(stops_of(shape)), 0, owners)
      return True
    else:  # every batch begun: a group none in flight can add to goes on as it is
      ready = [k for k, v in waiting.items() if v and not can_grow(*k)]
      if not ready:
        return False
      key = max(ready, key=lambda k: k[2])
    size = key[0][0]
    group, waiting[key] = waiting[key][:size], waiting[key][size:]
    entries = [one for one, _ in group]
    entries += [beam_pieces.spare(entries[-1])] * (size - len(group))
    submit(beam_pieces.join(entries), *key, [i for _, i in group] + [None] * (size - len(group)))
    return True

  try:
    while todo or inflight or any(waiting.values()):
      while len(inflight) < queued and next_work():
        pass
      if parallel_batches == 1:  # the pieces in the order they began: the same on every run
        done_now = [next(iter(inflight))]
      else:
        done_now, _ = concurrent.futures.wait(inflight, return_when="FIRST_COMPLETED")
      for future in done_now:
        shape, stops, stage, owners = inflight.pop(future)
        piece, outputs, done, stepped, searched = future.result()
        computed += beam * stepped
        last = stops[stage] == stops[-1]
        live = []
        for r, i in enumerate(owners):
          if i is None:
            continue
          if done[r] or last:
            finish(i, outputs, r)
            needed += beam * int(searched[r])
          else:
            live.append(r)
        if len(live) == shape[0] and later_shape(shape) == shape:  # on as it is
          submit(piece, shape, stops, stage + 1, owners)
        elif live:
          host = jax.tree_util.tree_map(np.asarray, piece)
          waiting.setdefault((later_shape(shape), stops, stage + 1), []).extend(
            (beam_pieces.entry(host, r), owners[r]) for r in live
          )
  finally:
    pool.shutdown(cancel_futures=True)
  return computed, needed
