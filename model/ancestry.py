"""Beam search without moving the self-attention buffers: each row's keys and values stay where
that row wrote them, and a step reads them through an ancestry table.

Beam search reorders its carried cache every step (each new beam takes its parent's rows). For
the `TARGET` buffers (model/cache_kinds.py: one slot per position, grown segment by segment)
that is the biggest copy of a step, and XLA:CPU makes it twice: a gather into a new buffer, then
a copy into the loop's own (docs/experiments.md measures it). Here the buffers are never
reordered. The table says, for each row and position, which row wrote that position of the row's
hypothesis (as an offset from the row: `row + table[row, position]`); a step gathers the buffers
through it (each row's history as the reordered buffers would hold it, the same values, read
once), runs the decoder on that, and writes only the new position back, in place; the reorder
moves the table's rows alone.

    if ancestry.applies(cache):   # a carried cache {kind: tree}, e.g. decoder_state's
      step, cache = ancestry.in_place_step(step), ancestry.with_table(cache)
      search.beam_search(step, cache, ..., grow=grow_target, reorder=ancestry.reorder)

It applies to a cache whose `STATE` entries are all counters shared by every row (rank 0: the
Transformer's decode index and position, an ensemble's too), so that a step writes one position,
the same in every row, at that counter. The table is kept in the `TARGET` tree under `TABLE`
([rows, positions, 1]: grown, paused and joined with the buffers); its offsets stay right when
whole sentences' rows move together (model/beam_pieces.py's entries)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from model import cache_kinds
from model.indices import put_rows, take_rows
from model.search import beam_rows, gather_beams

TABLE = "ancestry"  # the table's key in the carried cache's `TARGET` tree


def applies(carried) -> bool:
  """Whether the carried cache ({kind: tree}) can be kept in place: `TARGET` buffers, and every
  `STATE` entry a counter shared by all rows."""
  target = jax.tree_util.tree_leaves(carried.get(cache_kinds.TARGET, {}))
  state = jax.tree_util.tree_leaves(carried.get(cache_kinds.STATE, {}))
  return bool(target) and bool(state) and all(jnp.ndim(x) == 0 for x in state)


def with_table(carried):
  """The carried cache with the table of a search whose rows have not moved (all offsets 0;
  `grow_target` grows it with the buffers)."""
  target = carried[cache_kinds.TARGET]
  leaf = jax.tree_util.tree_leaves(target)[0]
  table = jnp.zeros((leaf.shape[0], leaf.shape[-2], 1), jnp.int32)
  return {**carried, cache_kinds.TARGET: {**target, TABLE: table}}


def kept_in_place(carried) -> bool:
  """Whether the carried cache has the table (`with_table`)."""
  return TABLE in carried.get(cache_kinds.TARGET, {})


def in_place_step(step):
  """`step` (over a cache without the table) run on the buffers as the reordered ones would be,
  writing the new position back into the buffers kept in place."""

  def stepped(ids, carried):
    target, table, column = _opened(carried)
    rows = jnp.arange(table.shape[0], dtype=jnp.int32)
    histories = _histories(target, rows, table)
    logits, out = step(ids, {**carried, cache_kinds.TARGET: histories})
    new = lambda x, h: lax.dynamic_update_slice_in_dim(
      x, lax.dynamic_slice_in_dim(h, column, 1, axis=-2), column, axis=-2
    )
    written = jax.tree_util.tree_map(new, target, out[cache_kinds.TARGET])
    own = jnp.zeros((table.shape[0], 1, 1), jnp.int32)  # each row wrote its own new position
    table = lax.dynamic_update_slice_in_dim(table, own, column, axis=1)
    return logits, {**out, cache_kinds.TARGET: {**written, TABLE: table}}

  return stepped


def step_rows(step, ids, carried, rows):
  """`in_place_step(step)` over the rows `rows` [m] of the carried cache only: `step` runs on
  their histories (`ids` [m, 1]) and their new position is written back; every other row is left
  as it was. Returns (logits [m, ...], carried). The rows need not be contiguous (each whole
  sentence's beams: model/live_chunks.py)."""
  target, table, column = _opened(carried)
  histories = _histories(target, rows, take_rows(table, rows))
  logits, out = step(ids, {**carried, cache_kinds.TARGET: histories})
  new = lambda x, h: put_rows(x, (rows, ..., column, slice(None)), h[..., column, :])
  written = jax.tree_util.tree_map(new, target, out[cache_kinds.TARGET])
  table = put_rows(table, (rows, column), 0)
  return logits, {**out, cache_kinds.TARGET: {**written, TABLE: table}}


def reorder_rows(carried, rows, parents):
  """`reorder` of the rows `rows` [m] only: row rows[i] goes on from the hypothesis of row
  parents[i] (a row of the same sentence). The cache's other entries are shared counters
  (`applies`), which no reorder moves."""
  target = dict(carried[cache_kinds.TARGET])
  table = target[TABLE]
  moved = (parents - rows).astype(jnp.int32)[:, None, None]
  target[TABLE] = put_rows(table, rows, take_rows(table, parents) + moved)
  return {**carried, cache_kinds.TARGET: target}


def reorder(carried, indices, batch: int, beam: int):
  """`search.gather_beams` for a cache kept in place: every entry but the `TARGET` buffers
  reordered, the table's rows taken from their parents (offsets from the new rows)."""
  target = dict(carried[cache_kinds.TARGET])
  table = target.pop(TABLE)
  rest = gather_beams(
    {k: v for k, v in carried.items() if k != cache_kinds.TARGET}, indices, batch, beam
  )
  parents = beam_rows(indices, batch, beam)
  moved = parents - jnp.arange(parents.shape[0], dtype=parents.dtype)
  table = take_rows(table, parents) + moved.astype(jnp.int32)[:, None, None]
  return {**rest, cache_kinds.TARGET: {**target, TABLE: table}}


def _opened(carried):
  """(the `TARGET` buffers without the table, the table, the position this step writes)."""
  target = dict(carried[cache_kinds.TARGET])
  table = target.pop(TABLE)
  return target, table, jax.tree_util.tree_leaves(carried[cache_kinds.STATE])[0]


def _histories(target, rows, offsets):
  """The buffers of `target` as rows `rows` [m] hold their hypotheses, `offsets` [m, positions,
  1] being those rows of the table."""
  sources = rows[:, None] + offsets[..., 0]  # [m, positions]
  positions = jnp.arange(offsets.shape[1])[None, :]
  return jax.tree_util.tree_map(lambda x: _through(x, sources, positions), target)


def _through(x, rows, positions):
  """Buffer `x` [n, ..., positions, d] as row r's hypothesis holds it: position p from row
  rows[r, p]."""
  return jnp.moveaxis(take_rows(x, (rows, ..., positions, slice(None))), 1, -2)
