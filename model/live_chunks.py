"""Beam search steps computed only for the sentences still searching, a chunk at a time.

A batch's step loop (model/search.py) runs every row until its last sentence is done: a batch of
16 whose one straggler searches ten steps more computes 16 sentences' rows for those ten steps.
Here each step orders the batch's sentences still searching first and runs the decoder step and
`beam_advance` on chunks of `chunk` of them, as many chunks as hold one, so the rows computed
follow the sentences still searching (rounded up to a chunk), as CTranslate2's search drops its
finished ones. A sentence is left out once it is done with `beam` finished hypotheses, when its
outputs are final (model/search.py's `beam_best` reads no live row of it); one done without
(no live beam left) is computed on as before.

    step_for = lambda idx: cached_step(model, params, source rows idx)   # C sentences' step
    state = live_chunks.run(step_for, state, max_len, C, (segment, grow, start, until), ...)

It needs a cache kept in place (model/ancestry.py), whose rows a chunk reads through the table
and writes one position of, wherever its sentences' rows are. A chunk's products run over
`chunk x beam` rows instead of the batch's, which XLA:CPU may round differently in the last bits
(docs/experiments.md): in float32 the same texts, scores a few units in the last place apart;
in int8 a rare text may part too (one line of 5,000). `chunk_size` picks the chunk: rows enough
for the products (MIN_CHUNK_ROWS to CHUNK_ROWS), a divisor of the batch, at most a quarter of it
(MIN_CHUNKS).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from model import ancestry, cache_kinds, search
from model.indices import put_rows, take_rows

# Rows a chunk holds at most and at least, and the fewest chunks a batch splits into: a batch of
# 16 sentences of beam 5 steps chunks of 4 sentences (20 rows), one of 8 steps whole. Two chunks of
# a batch leave out too few finished sentences for what a chunk's own calls cost (each product
# reading its weights again, its rows gathered and written back): 20-row halves of 8 long
# sentences were slower than the whole batch, 20-row quarters of 16 faster than 40-row halves
# (docs/experiments.md, "Chunks by their rows, not by the dtype" and "Quarters of a piece").
CHUNK_ROWS = 40
MIN_CHUNK_ROWS = 16
MIN_CHUNKS = 4
_AT = "live_chunks"  # the loop's own entry in the cache while it runs (`run`)


def chunk_size(batch: int, beam: int) -> int | None:
  """Sentences per chunk for a batch of `batch` sentences of `beam` rows: the largest divisor of
  `batch` with at most `CHUNK_ROWS` rows and at most `batch // MIN_CHUNKS` sentences, if it has at
  least `MIN_CHUNK_ROWS` rows; else None (the batch is stepped whole)."""
  for size in range(min(batch // MIN_CHUNKS, CHUNK_ROWS // beam), 0, -1):
    if batch % size == 0:
      return size if size * beam >= MIN_CHUNK_ROWS else None
  return None


def _put(s, idx, part):
  """`s` with entries `idx` replaced by `part`'s (both without the cache)."""
  put = lambda x, y: x if jnp.ndim(x) == 0 else put_rows(x, idx, y)
  return jax.tree_util.tree_map(put, s, part)


def run(
  step_for: Callable, s, max_len: int, chunk: int, segments: tuple, *, max_lens=None, **rules
):
  """Beam search state `s` searched on over a cache kept in place (`ancestry.kept_in_place`),
  each step run on chunks of `chunk` sentences (it divides the batch) holding those still
  searching; one loop iteration per chunk, so that XLA keeps what the steps share out of it.

  `step_for(idx)`: the step function of the sentences `idx` [chunk] (their source rows), over
  `chunk * beam` rows; `segments`: `search.segmented_loop`'s (segment, grow, start, until);
  `max_lens` [batch] or None; `rules`: `search.beam_advance`'s alpha, penalty and stopping.
  Entries are never moved: a chunk reads and writes its sentences' rows where they are."""
  b, k = s.tok.shape
  if b % chunk:
    raise ValueError(f"live_chunks: chunk {chunk} does not divide the batch of {b}")
  rules = dict(rules, max_len=max_len)
  beams = jnp.arange(k, dtype=jnp.int32)
  per_entry = lambda s: s._replace(cache=None, t=None)

  def body(s):
    cache = dict(s.cache)
    at = cache.pop(_AT)  # this chunk's place in its step, the step's order and counters
    first = at["j"] == 0
    searching = ~(s.done & jnp.all(s.fin_flags, axis=1))
    order = jnp.where(first, jnp.argsort(~searching, stable=True).astype(jnp.int32), at["order"])
    chunks = jnp.where(first, (jnp.sum(searching) + chunk - 1) // chunk, at["chunks"])
    counters = jax.tree_util.tree_map(
      lambda now, kept: jnp.where(first, now, kept), cache[cache_kinds.STATE], at["counters"]
    )
    idx = lax.dynamic_slice_in_dim(order, at["j"] * chunk, chunk)
    rows = (idx[:, None] * k + beams).reshape(-1)
    ids = take_rows(s.tok, idx).reshape(chunk * k, 1)
    cache = {**cache, cache_kinds.STATE: counters}
    logits, cache = ancestry.step_rows(step_for(idx), ids, cache, rows)
    part = search.map_batched(lambda x: take_rows(x, idx), per_entry(s))._replace(t=s.t)
    lens = None if max_lens is None else take_rows(max_lens, idx)
    part, parents = search.beam_advance(part, logits, max_lens=lens, **rules)
    cache = ancestry.reorder_rows(cache, rows, rows[search.beam_rows(parents, chunk, k)])
    last = at["j"] + 1 == chunks  # the step's last chunk: its counters and t go on
    cache[cache_kinds.STATE] = jax.tree_util.tree_map(
      lambda on, kept: jnp.where(last, on, kept), cache[cache_kinds.STATE], counters
    )
    j = jnp.where(last, 0, at["j"] + 1)
    cache[_AT] = dict(j=j, order=order, chunks=chunks, counters=counters)
    stepped = _put(per_entry(s), idx, per_entry(part))
    return stepped._replace(cache=cache, t=jnp.where(last, s.t + 1, s.t))

  def cond(s):  # a step begun is finished
    return (s.cache[_AT]["j"] > 0) | ((s.t < max_len) & ~jnp.all(s.done))

  counters = s.cache[cache_kinds.STATE]
  at = dict(
    j=jnp.int32(0), order=jnp.zeros((b,), jnp.int32), chunks=jnp.int32(0), counters=counters
  )
  s = s._replace(cache={**s.cache, _AT: at})
  s = search.segmented_loop(cond, body, s, max_len, *segments)
  cache = dict(s.cache)
  cache.pop(_AT)
  return s._replace(cache=cache)
