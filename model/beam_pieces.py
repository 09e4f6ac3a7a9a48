"""`generate`'s beam search of one model run in pieces: a batch searched to a pause step, then on
from there, so that the sentences still searching in several paused batches can be gathered into
full batches and go on (inference/merged_search.py does), instead of each batch stepping all its
rows until its last sentence is done.

    piece, found = begin(model, params, inputs, settings, max_decode_len, until=16)
    # ... the entries still searching of several pieces at step 16 into one: `entry`, `join`
    piece, found = resume(model, params, piece, settings, max_decode_len, start=16, until=32)

The pauses are the cache's segment ends (`search.pause_steps`), so a search in pieces compiles
as many step loops as one `generate` (`begin`: encode and the first loop; `resume`: grow the
self-attention buffers and the loop up to the next pause). A piece's steps run over the chunks of
its sentences still searching (model/live_chunks.py) when its cache is kept in place and its batch
splits into chunks (`live_chunks.chunk_size`), else over all its rows (`batch x beam`), as the
batch's own search would: a sentence's search is the one `generate` gives it, its outputs to the
last bit when no chunk splits the batch (a chunk's products may round otherwise). A first piece
that pauses steps all its rows: before the first pause few sentences are done, and a chunk's
calls cost more than the rows it would leave out (docs/experiments.md); a search in one piece,
and every piece after a pause, leaves its finished sentences out.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from model import ancestry, cache_kinds, live_chunks, search
from model.decoder_state import (
  DECODE_SEGMENT,
  cached_step,
  first_cache,
  grow_target,
  initial_cache,
  matrices_for_decoding,
)
from model.generate import OUTPUTS, best_outputs
from model.indices import take_rows
from model.search_settings import MARIAN, SearchSettings
from model.token_step import output_limits


class BeamPiece(NamedTuple):
  """A beam search between two pieces: its state (the carried cache inside, leaves
  [batch * beam, ...]), the `SOURCE` cache entries its steps read ([batch, ...]) and each
  entry's output limit [batch]. Every leaf but the state's step counter has the entries first."""

  state: Any
  source: Any
  max_lens: Any


def supported(settings: SearchSettings, *, ensemble: bool, use_cache: bool, prefix) -> bool:
  """Whether `begin` and `resume` run this search: beam search (GNMT or fairseq penalty) of one
  model with its cache, no target prefix."""
  return (
    settings.beam_size > 1
    and not settings.sampling
    and settings.length_penalty != MARIAN
    and not ensemble
    and use_cache
    and prefix is None
  )


def _outputs(piece: BeamPiece, settings: SearchSettings, outputs: str):
  """`generate`'s outputs of every entry of `piece`, as if its search ended there."""
  found = search.beam_best(piece.state, settings.alpha, settings.length_penalty)
  return best_outputs(found, OUTPUTS.index(outputs) + 1, settings.num_hypotheses)


def _initial(model, params, inputs, settings, max_decode_len, outputs, segment):
  """(the piece of `inputs` before its first step, its cache's first length: None when nothing
  grows); `params` as `matrices_for_decoding` gives them."""
  initial, length = first_cache(
    lambda n: initial_cache(model, params, inputs, n), max_decode_len, segment
  )
  carried = {kind: initial[kind] for kind in cache_kinds.CARRIED}
  if ancestry.applies(carried):  # the self-attention buffers kept in place (model/ancestry.py)
    carried = ancestry.with_table(carried)
  b, k = inputs.shape[0], settings.beam_size
  state = search.beam_start(
    b, k, max_decode_len, search.expand_to_beams(carried, k), outputs == OUTPUTS[2], True
  )
  limits = output_limits(inputs, None, settings.max_extra_len)
  return BeamPiece(state, initial[cache_kinds.SOURCE], limits), length


def begin(
  model,
  params,
  inputs,
  settings: SearchSettings,
  max_decode_len: int,
  until: int,
  *,
  outputs: str = "ids",
  num_ids: int | None = None,
  segment: int | None = DECODE_SEGMENT,
):
  """Encodes `inputs` [batch, src_len] and beam-searches until step `until` (a pause step, see
  module doc, or `max_decode_len`) or every entry is done: (the `BeamPiece`, `generate`'s
  outputs of every entry as if its search ended there, `outputs` as `generate`'s). The state
  counts each entry's steps (`state.searched`)."""
  params = matrices_for_decoding(model, params)
  piece, first = _initial(model, params, inputs, settings, max_decode_len, outputs, segment)
  return _run(model, params, piece, settings, max_decode_len, 0, until, outputs, num_ids, first)


def initial_shape(
  model,
  params,
  inputs,
  settings: SearchSettings,
  max_decode_len: int,
  *,
  outputs: str = "ids",
  segment: int | None = DECODE_SEGMENT,
) -> BeamPiece:
  """The shapes and dtypes (`jax.ShapeDtypeStruct`s) of the piece `begin` starts from, for
  inputs shaped as `inputs` (traces the encoder and the cache, not a search step)."""

  def initial(params, inputs):
    params = matrices_for_decoding(model, params)
    return _initial(model, params, inputs, settings, max_decode_len, outputs, segment)[0]

  return jax.eval_shape(initial, params, inputs)


def paused_shape(
  initial: BeamPiece, start: int, max_decode_len: int, segment: int | None = DECODE_SEGMENT
) -> BeamPiece:
  """The shapes of the piece `resume` takes at pause step `start`, from `initial_shape`'s: its
  self-attention buffers (when they grow) `start` positions long."""
  if not (segment and segment < max_decode_len):
    return initial
  at = lambda x: jax.ShapeDtypeStruct(x.shape[:-2] + (start,) + x.shape[-1:], x.dtype)
  cache = dict(initial.state.cache)
  cache[cache_kinds.TARGET] = jax.tree_util.tree_map(at, cache[cache_kinds.TARGET])
  return initial._replace(state=initial.state._replace(cache=cache))


def resume(
  model,
  params,
  piece: BeamPiece,
  settings: SearchSettings,
  max_decode_len: int,
  start: int,
  until: int,
  *,
  outputs: str = "ids",
  num_ids: int | None = None,
  segment: int | None = DECODE_SEGMENT,
):
  """`begin`'s pair for `piece`, paused at step `start`, searched on to step `until` (a later
  pause step, or `max_decode_len`: to the end)."""
  params = matrices_for_decoding(model, params)
  grows = bool(jax.tree_util.tree_leaves(piece.state.cache[cache_kinds.TARGET]))
  first = segment if grows and segment and segment < max_decode_len else None
  return _run(model, params, piece, settings, max_decode_len, start, until, outputs, num_ids, first)


def _run(model, params, piece, settings, max_decode_len, start, until, outputs, num_ids, first):
  """The piece searched from step `start` to `until` over a cache whose buffers grew from
  `first` positions (None: nothing grows), and its outputs."""
  rules = dict(alpha=settings.alpha, penalty=settings.length_penalty, stopping=settings.stopping)
  grow = None if first is None else grow_target
  shape = piece.state.tok.shape
  kept = ancestry.kept_in_place(piece.state.cache)
  pausing_first = not start and until < max_decode_len  # all rows (module doc)
  chunk = None
  if kept and not pausing_first:
    chunk = live_chunks.chunk_size(*shape)
  if chunk:  # only the chunks of sentences still searching (model/live_chunks.py)
    source = lambda idx: jax.tree_util.tree_map(lambda x: take_rows(x, idx), piece.source)
    step_for = lambda idx: cached_step(model, params, source(idx), num_ids)
    segments = (first, grow, start, until)
    state = live_chunks.run(
      step_for, piece.state, max_decode_len, chunk, segments, max_lens=piece.max_lens, **rules
    )
  else:
    step, reorder = cached_step(model, params, piece.source, num_ids), None
    if kept:
      step, reorder = ancestry.in_place_step(step), ancestry.reorder
    state = search.beam_resume(
      step,
      piece.state,
      max_decode_len,
      start=start,
      until=until,
      grow=grow,
      segment=first,
      max_lens=piece.max_lens,
      reorder=reorder,
      **rules,
    )
  piece = piece._replace(state=state)
  return piece, _outputs(piece, settings, outputs)


def entry(piece: BeamPiece, row: int) -> BeamPiece:
  """Entry `row` of `piece` (numpy leaves) as a piece of one entry, its leaves copied (so the
  piece's other rows can go): per-entry leaves [1, ...], the cache's [beam, ...]."""
  rows, beams = piece.state.tok.shape

  def one(x):
    if np.ndim(x) == 0:
      return x
    if x.shape[0] == rows * beams:
      return np.array(x[row * beams : (row + 1) * beams])
    return np.array(x[row : row + 1])

  return jax.tree_util.tree_map(one, piece)


def spare(one: BeamPiece) -> BeamPiece:
  """A one-entry piece (`entry`'s) that fills a row of a joined piece without searching: a copy
  of `one` marked done with every finished slot taken, so a step over the sentences still
  searching leaves it out (model/live_chunks.py) and a whole step's loop ends without it. Its
  outputs mean nothing."""
  state = one.state
  done, flags = np.ones_like(state.done), np.ones_like(state.fin_flags)
  return one._replace(state=state._replace(done=done, fin_flags=flags))


def join(entries: list) -> BeamPiece:
  """One piece of the one-entry pieces `entries` (`entry`'s), all paused at the same step and
  from batches of one shape, in that order."""
  return jax.tree_util.tree_map(
    lambda *xs: xs[0] if np.ndim(xs[0]) == 0 else np.concatenate(xs), *entries
  )
