"""Top-k selections identical to `lax.top_k`, including ties (lower index first), computed in
stages that run faster on CPU than one `top_k` over a long axis, as beam search takes them every
step (model/search.py).

    values, flat = beams_top_k(x, n)           # x [batch, beam, vocab]: flat index into beam*vocab
    values, flat, logp = log_softmax_top_k(logits, offset, n)   # the same of offset + log-softmax

XLA:CPU runs `lax.top_k` as a library call (a partial sort) only while every consumer takes all
`n` results; one taking fewer (`values[:, :k]`) turns it into a full sort of the row, several
times slower. The selections here hand their results out through `lax.optimization_barrier`, so
no consumer changes how they run.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from model.indices import divmod_index, take_along


def _top_k(x, n: int):
  """``lax.top_k(x, n)``, its results behind an optimization barrier (module doc)."""
  return lax.optimization_barrier(lax.top_k(x, n))


def _sliced_top_k(x, n: int, chunk: int):
  """``lax.top_k`` over the last two axes of ``x`` ``[..., rows, width]`` taken as one flat axis
  of ``rows * width``: values and int32 flat indices ``[..., n]``, identical including ties.

  Order the elements by (value descending, flat index ascending). Cut each row into slices of
  ``chunk`` elements (the last one shorter when ``chunk`` does not divide ``width``): each of the
  top ``n`` lies in one of the ``n`` slices whose best elements rank highest, since a slice
  outside those holds no element that outranks ``n`` others. So: one pass for the slice maxima,
  ``top_k`` over those, then ``top_k`` over the elements of the chosen slices laid out in flat
  index order (a shorter slice's missing elements as -inf after all of them: never taken, each
  chosen slice holding at least one element). On CPU a ``top_k`` over a long axis is far slower
  than a max reduction over it. Slices stay within a row: cut across rows of a width that
  ``chunk`` does not divide, XLA:CPU computes ``x`` itself (beam search's sum of scores) several
  times slower. Few slices: plain ``top_k``.
  """
  *lead, rows, width = x.shape
  flat = x.reshape(*lead, rows * width)
  whole, short = divmod(width, chunk)  # full slices per row, the length of a shorter last one
  if rows * width <= 4 * chunk or n > rows * whole:
    return _top_k(flat, n)
  per_row = whole + (short > 0)  # slices per row
  maxima = jnp.max(x[..., : whole * chunk].reshape(*lead, rows, whole, chunk), axis=-1)
  if short:
    maxima = jnp.concatenate([maxima, jnp.max(x[..., whole * chunk :], axis=-1)[..., None]], -1)
  _, chosen = _top_k(maxima.reshape(*lead, rows * per_row), n)  # [..., n] slice numbers
  chosen = jnp.sort(chosen, axis=-1)  # flat index order
  if not short:  # slices tile the flat axis: gather them whole
    cand = jnp.take_along_axis(flat.reshape(*lead, -1, chunk), chosen[..., None], axis=-2)
    values, j = _top_k(cand.reshape(*lead, n * chunk), n)
    index = jnp.take_along_axis(chosen, j // chunk, axis=-1) * chunk + j % chunk
    return values, index.astype(jnp.int32)
  row, part = chosen // per_row, chosen % per_row
  start = row * width + part * chunk  # [..., n] each chosen slice's first flat index
  size = jnp.where(part == whole, short, chunk)
  offset = jnp.cumsum(size, axis=-1) - size  # [..., n] its first candidate's position
  at = jnp.arange(n * chunk)  # candidate positions, the slices' elements packed in order
  slot = jnp.sum(at[:, None] >= offset[..., None, :], axis=-1) - 1  # [..., n*chunk] the slice
  index = jnp.take_along_axis(start - offset, slot, axis=-1) + at  # each one's flat index
  real = at < jnp.sum(size, axis=-1, keepdims=True)
  index = jnp.where(real, index, 0)
  cand = jnp.where(real, jnp.take_along_axis(flat, index, axis=-1), -jnp.inf)
  values, j = _top_k(cand, n)
  return values, jnp.take_along_axis(index, j, axis=-1).astype(jnp.int32)


def beams_top_k(x, n: int, chunk: int = 64):
  """``lax.top_k(x.reshape(batch, beam * vocab), n)``: ``x`` is ``[batch, beam, vocab]``;
  values and flat int32 indices into ``beam * vocab``, both ``[batch, n]``, identical to the
  flat ``top_k`` including ties (lower flat index first).

  ``_sliced_top_k`` over each sentence's ``beam * vocab`` entries at once, in slices of ``chunk``
  tokens of one beam: no ``top_k`` per beam, only one over the sentence's slice maxima and one
  over its ``n * chunk`` candidates, which on CPU cost far less than one per beam and a third
  over the ``beam * n`` survivors.
  """
  return _sliced_top_k(x, n, chunk)


def log_softmax_top_k(x, offset, n: int, chunk: int = 64, only=None, only_id: int = 0):
  """``beams_top_k(offset[..., None] + jax.nn.log_softmax(x), n)`` and the chosen entries'
  log-probabilities, identical including ties, without the log-softmax written out: ``x``
  ``[batch, beam, vocab]`` float32 logits, ``offset`` ``[batch, beam]``. ``only`` (``[batch,
  beam]`` bool, or None): rows whose log-probabilities are 0 at ``only_id`` and -inf elsewhere,
  whatever ``x`` (model/token_step.py's forced EOS). Returns values and flat int32 indices into
  ``beam * vocab`` (``[batch, n]``), and the log-probabilities of the chosen entries.

  An entry's score ``offset + ((x - max) - lse)``, rounded as log-softmax and the sum round it, is
  non-decreasing in ``x`` within a row, so a slice's best score is the score of its largest
  logit: the slice maxima are taken of ``x`` (a plain max, no pass writing the log-softmax and
  another the scores, each the size of the logits), then scored; the chosen slices' logits are
  scored as ``beams_top_k`` would have them."""
  b, k, vocab = x.shape
  slices = vocab // chunk
  whole = not (vocab % chunk or k * vocab <= 4 * chunk or n > k * slices)
  if whole:  # slices tile each row: its maximum is theirs
    # Behind a barrier, the maxima are written once and both readers take them: else XLA merges
    # the two maxima into one reduction over the logits and computes the slices' again for the
    # scores, a pass more over [batch, beam, vocab] each step.
    maxima = lax.optimization_barrier(jnp.max(x.reshape(b, k, slices, chunk), axis=-1))
    top = jnp.max(maxima, axis=-1)
  else:
    top = jnp.max(x, axis=-1)  # [b, k] as jax.nn.log_softmax shifts and sums
  lse = jnp.log(jnp.sum(jnp.exp(x - top[..., None]), axis=-1))
  forced = jnp.zeros((b, k), bool) if only is None else only

  def score(v, top, lse, offset, forced, is_only):  # v and is_only [b, ..., m]; the rest [b, ...]
    logp = (v - top[..., None]) - lse[..., None]
    logp = jnp.where(forced[..., None], jnp.where(is_only, 0.0, -jnp.inf), logp)
    return offset[..., None] + logp, logp

  if not whole:
    scores, logp = score(x, top, lse, offset, forced, jnp.arange(vocab) == only_id)
    values, flat = beams_top_k(scores, n, chunk)
    return values, flat, jnp.take_along_axis(logp.reshape(b, k * vocab), flat, axis=1)
  best, _ = score(maxima, top, lse, offset, forced, jnp.arange(slices) == only_id // chunk)
  _, chosen = _top_k(best.reshape(b, k * slices), n)
  chosen = jnp.sort(chosen, axis=-1)  # [b, n] slice numbers, in flat index order
  cand = take_along(x.reshape(b, k * slices, chunk), chosen[..., None], axis=1)
  beam, part = divmod_index(chosen, slices)
  row = lambda a: take_along(a, beam, axis=1)  # [b, k] -> [b, n]
  ids = part[..., None] * chunk + jnp.arange(chunk)  # [b, n, chunk]
  scores, logp = score(cand, row(top), row(lse), row(offset), row(forced), ids == only_id)
  values, j = _top_k(scores.reshape(b, n * chunk), n)
  slot, at = divmod_index(j, chunk)
  flat = take_along(chosen, slot, axis=-1) * chunk + at
  return values, flat.astype(jnp.int32), take_along(logp.reshape(b, -1), j, axis=1)
