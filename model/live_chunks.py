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
    body, cond = live_chunks.beam_loop(step_for, batch, beam, max_len, C, alpha=..., ...)
    state = search.segmented_loop(cond, body, state, max_len, ...)

It needs a cache kept in place (model/ancestry.py), whose rows a chunk reads through the table
and writes one position of, wherever its sentences' rows are. A chunk's products run over
`chunk x beam` rows instead of the batch's, which XLA:CPU may round differently in the last bits
(docs/experiments.md); every chunk has that many rows, so a sentence's outputs do not depend on
which others share its chunk. `chunk_size` picks the chunk: rows enough for the products
(CHUNK_ROWS), a divisor of the batch, smaller than it.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from model import ancestry, cache_kinds, search

# Rows a chunk holds at most and, halved, at least: the most rows per chunk that still leaves out
# finished sentences at a fine grain; fewer than half of it cost more per row than they save
# (docs/experiments.md, "Steps over the sentences still searching").
CHUNK_ROWS = 40


def chunk_size(batch: int, beam: int) -> int | None:
  """Sentences per chunk for a batch of `batch` sentences of `beam` rows: the largest divisor of
  `batch` below it with at most `CHUNK_ROWS` rows, if it has at least half as many; else None
  (the batch is stepped whole)."""
  rows = CHUNK_ROWS
  for size in range(min(batch - 1, rows // beam), 0, -1):
    if batch % size == 0:
      return size if size * beam >= rows // 2 else None
  return None


def _entries(s, idx):
  """The per-entry leaves of state `s` (its cache left out) at entries `idx`."""
  return jax.tree_util.tree_map(lambda x: x if jnp.ndim(x) == 0 else x[idx], s)


def _put(s, idx, part):
  """`s` with entries `idx` replaced by `part`'s (both without the cache)."""
  return jax.tree_util.tree_map(lambda x, y: x if jnp.ndim(x) == 0 else x.at[idx].set(y), s, part)


def beam_loop(
  step_for: Callable, batch: int, beam: int, max_len: int, chunk: int, *, max_lens=None, **rules
):
  """(body, cond) of beam search's step loop (`search.segmented_loop` runs them) over a cache
  kept in place (`ancestry.kept_in_place`), each step run on chunks of `chunk` sentences (it
  divides `batch`) holding those still searching.

  `step_for(idx)`: the step function of the sentences `idx` [chunk] (their source rows), over
  `chunk * beam` rows; `max_lens` [batch] or None; `rules`: `search.beam_advance`'s alpha,
  penalty and stopping. Entries are never moved: a chunk reads and writes its sentences' rows
  where they are."""
  b, k = batch, beam
  if b % chunk:
    raise ValueError(f"live_chunks: chunk {chunk} does not divide the batch of {b}")
  rules = dict(rules, max_len=max_len)
  rules["stopping"] = search.stopping_rule(rules["penalty"], rules.get("stopping"))
  beams = jnp.arange(k, dtype=jnp.int32)

  def body(s):
    counters = s.cache[cache_kinds.STATE]  # every chunk steps from this step's counters
    searching = ~(s.done & jnp.all(s.fin_flags, axis=1))
    order = jnp.argsort(~searching, stable=True).astype(jnp.int32)
    chunks = (jnp.sum(searching) + chunk - 1) // chunk

    def one(j, s):
      idx = lax.dynamic_slice_in_dim(order, j * chunk, chunk)
      rows = (idx[:, None] * k + beams).reshape(-1)
      cache = {**s.cache, cache_kinds.STATE: counters}
      ids = s.tok[idx].reshape(chunk * k, 1)
      logits, cache = ancestry.step_rows(step_for(idx), ids, cache, rows)
      part = _entries(s._replace(cache=None, t=None), idx)._replace(t=s.t)
      lens = None if max_lens is None else max_lens[idx]
      part, parents = search.beam_advance(part, logits, max_lens=lens, **rules)
      cache = ancestry.reorder_rows(cache, rows, rows[search.beam_rows(parents, chunk, k)])
      stepped = _put(s._replace(cache=None, t=None), idx, part._replace(cache=None, t=None))
      return stepped._replace(cache=cache, t=s.t)

    return lax.fori_loop(0, chunks, one, s)._replace(t=s.t + 1)

  def cond(s):
    return (s.t < max_len) & ~jnp.all(s.done)

  return body, cond
