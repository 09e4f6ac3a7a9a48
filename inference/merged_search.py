"""`Generator.translate_all`'s beam search with the sentences still searching merged across
batches: each length batch is searched in pieces (model/beam_pieces.py) paused at the cache's
segment ends (steps 16, 32, 64, ... by default); at a pause its finished sentences are taken,
and the entries still searching in batches that have finished ones wait until a whole batch of
them (same shape, same step) can go on together. A batch no longer steps all its rows until its
last sentence is done: the rows a finished sentence would fill are searched for another. Every
step still runs over a batch's full rows, so each sentence's outputs are, to the last bit, those
of its own batch's search.

Streaming, not batch by batch: `parallel_batches` pieces run at any time and one more waits for
the first thread to be free (each piece ends in host work before the next is chosen); a freed
place goes to a full group of waiting entries (the latest pause first), else to the next batch;
once every batch has begun, a group that no piece in flight can add to goes on as it is, its
spare rows repeating its last entry. A waiting entry is a host copy of its own rows only; at
most a batch's rows less one wait per shape and pause.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

import jax
import numpy as np

from model import beam_pieces, search

# A shape with fewer batches is searched whole: merging its few batches would save less than its
# pieces' programs cost to compile and read back (docs/experiments.md).
MIN_BATCHES = 4


def piece_stops(max_len: int, segment: int | None, batches: int) -> list[int]:
  """Where the pieces of a search of output width `max_len` (a cache growing from `segment`
  positions) pause, then `max_len`; a shape of fewer than `MIN_BATCHES` batches in one piece."""
  if batches < MIN_BATCHES:
    return [max_len]
  return search.pause_steps(max_len, segment) + [max_len]


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
    run: `run(shape, x, start, until)` -> (piece, outputs, done [rows] bool, t, searched
      [rows]) as numpy (the piece as the program returned it): `x` a batch of this shape's
      inputs (start 0) or a piece of its entries paused at `start`, searched to `until`.
    stops_of: a batch shape's pause steps, then its output width (where every search ends).
    beam: rows per sentence.
    finish: `finish(sentence, outputs, row)` for each sentence once done (any order).

  Returns:
    (rows x steps searched, rows x steps the sentences needed).
  """
  todo = list(range(len(batches)))[::-1]  # batches not begun, next last
  waiting: dict[tuple, list] = {}  # (shape, stage) -> [(one-entry piece, sentence)]
  inflight: dict[concurrent.futures.Future, tuple] = {}  # -> (shape, stage, owners)
  computed = needed = 0
  pool = concurrent.futures.ThreadPoolExecutor(parallel_batches)
  queued = parallel_batches + 1  # a thread done with a piece finds the next one waiting

  def can_grow(shape, stage) -> bool:  # once every batch has begun
    return any(s == shape and g < stage for s, g, _ in inflight.values())

  def submit(x, shape, stage, owners):
    stops = stops_of(shape)
    start = 0 if stage == 0 else stops[stage - 1]
    inflight[pool.submit(run, shape, x, start, stops[stage])] = (shape, stage, owners)

  def next_work() -> bool:
    full = [k for k, v in waiting.items() if len(v) >= k[0][0]]
    if full:
      key = max(full, key=lambda k: k[1])
    elif todo:
      n = todo.pop()
      rows = batches[n].inputs.shape[0]
      owners = list(batches[n].indices) + [None] * (rows - len(batches[n].indices))
      submit(batches[n].inputs, batches[n].inputs.shape, 0, owners)
      return True
    else:  # every batch begun: a group none in flight can add to goes on as it is
      ready = [k for k, v in waiting.items() if v and not can_grow(*k)]
      if not ready:
        return False
      key = max(ready, key=lambda k: k[1])
    group, waiting[key] = waiting[key][: key[0][0]], waiting[key][key[0][0] :]
    group += [group[-1]] * (key[0][0] - len(group))
    picked = beam_pieces.join([one for one, _ in group])
    submit(picked, key[0], key[1], _owners(group))
    return True

  try:
    while todo or inflight or any(waiting.values()):
      while len(inflight) < queued and next_work():
        pass
      done_now, _ = concurrent.futures.wait(inflight, return_when="FIRST_COMPLETED")
      for future in done_now:
        shape, stage, owners = inflight.pop(future)
        piece, outputs, done, t, searched = future.result()
        stops = stops_of(shape)
        start = 0 if stage == 0 else stops[stage - 1]
        computed += beam * shape[0] * (int(t) - start)
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
        if len(live) == shape[0]:  # every row a sentence still searching: on as it is
          submit(piece, shape, stage + 1, owners)
        elif live:
          host = jax.tree_util.tree_map(np.asarray, piece)
          waiting.setdefault((shape, stage + 1), []).extend(
            (beam_pieces.entry(host, r), owners[r]) for r in live
          )
  finally:
    pool.shutdown(cancel_futures=True)
  return computed, needed


def _owners(group: list) -> list:
  """The sentence of each row of a group's piece: None for the rows that repeat its last entry
  (their outputs are not taken)."""
  owners, seen = [], set()
  for _, i in group:
    owners.append(None if i in seen else i)
    seen.add(i)
  return owners
