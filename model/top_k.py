"""Top-k selections identical to `lax.top_k`, including ties (lower index first), computed in
stages that run faster on CPU than one `top_k` over a long axis, as beam search takes them every
step (model/search.py).

    values, index = chunked_top_k(x, n)        # x [..., width]
    values, flat = beams_top_k(x, n)           # x [batch, beam, vocab]: flat index into beam*vocab
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def chunked_top_k(x, n: int, chunk: int = 64):
  """``lax.top_k(x, n)`` over the last axis, identical including ties (lower index first), from
  the maxima of ``chunk``-wide slices.

  Order the elements by (value descending, index ascending). Each of the top ``n`` lies in one
  of the ``n`` slices whose best elements rank highest: a slice outside those holds no element
  that outranks ``n`` others. So: one pass for the slice maxima, ``top_k`` over those, then
  ``top_k`` over the ``n * chunk`` elements of the chosen slices taken in index order. On CPU a
  ``top_k`` over a long axis is far slower than a max reduction over it.
  """
  *lead, width = x.shape
  if width <= 4 * chunk or n > width // chunk:
    return lax.top_k(x, n)
  pad = (-width) % chunk
  slices = jnp.pad(x, [(0, 0)] * len(lead) + [(0, pad)], constant_values=-jnp.inf)
  slices = slices.reshape(*lead, -1, chunk)  # [..., slices, chunk]
  _, chosen = lax.top_k(jnp.max(slices, axis=-1), n)  # [..., n]
  chosen = jnp.sort(chosen, axis=-1)  # index order
  cand = jnp.take_along_axis(slices, chosen[..., None], axis=-2)  # [..., n, chunk]
  values, j = lax.top_k(cand.reshape(*lead, n * chunk), n)
  index = jnp.take_along_axis(chosen, j // chunk, axis=-1) * chunk + j % chunk
  return values, index.astype(jnp.int32)


def beams_top_k(x, n: int):
  """``lax.top_k(x.reshape(batch, beam * vocab), n)`` computed in two stages.

  ``x`` is ``[batch, beam, vocab]``; returns values and flat indices into
  ``beam * vocab``, both ``[batch, n]``, identical to the flat ``top_k``
  including ties (lower flat index first). The flat top ``n`` lies within the
  union of each beam's top ``n``, so ``top_k`` runs per beam, then over the
  ``beam * n`` survivors, which are laid out beam-major and, within a beam, in
  the per-beam order (value descending, ties by lower token). This avoids one
  large ``top_k`` over ``beam * vocab``, which is slow on CPU inside loops.
  """
  batch, beam, vocab = x.shape
  m = min(n, vocab)
  v1, i1 = chunked_top_k(x, m)  # [batch, beam, m]
  vals, j = lax.top_k(v1.reshape(batch, beam * m), n)  # [batch, n]
  tok = jnp.take_along_axis(i1.reshape(batch, beam * m), j, axis=1)
  return vals, (j // m) * vocab + tok
