"""Gathers and scatters by indices that a search computed itself: a top-k's or a sort's choices,
a beam's parent, a chunk's sentences, a row's ancestors. Such indices are in bounds and never
negative, so these ops are written without the bounds checks and negative-index fix-ups that
jnp's indexing adds by default; XLA:CPU fuses an index computation into every reader of the
gathered values and would otherwise compute that extra arithmetic again for each element read
(docs/experiments.md measures it). Same results as the plain indexing for such indices.

    take_rows(x, idx)            # x[idx] (leading axis)
    put_rows(x, idx, y)          # x.at[idx].set(y), idx distinct
    take_along(x, indices, axis) # jnp.take_along_axis
    quotient, rest = divmod_index(flat, vocab)
"""

from __future__ import annotations

import jax.numpy as jnp

_SAFE = dict(mode="promise_in_bounds", wrap_negative_indices=False)


def take_rows(x, idx):
  """`x[idx]`: entries `idx` of `x`'s leading axis (`idx` may be a tuple indexing several axes,
  as `x[idx]` takes it)."""
  return x.at[idx].get(**_SAFE)


def put_rows(x, idx, y):
  """`x.at[idx].set(y)` for distinct indices `idx` (or a tuple of them, as `take_rows`)."""
  return x.at[idx].set(y, unique_indices=True, **_SAFE)


def take_along(x, indices, axis: int):
  """`jnp.take_along_axis(x, indices, axis)`."""
  return jnp.take_along_axis(x, indices, axis, **_SAFE)


def divmod_index(index, size: int):
  """(`index // size`, `index % size`) of a non-negative int32 `index`, int32, computed unsigned
  (no sign handling)."""
  u = index.astype(jnp.uint32)
  return (u // size).astype(jnp.int32), (u % size).astype(jnp.int32)
