"""model/indices.py: gathers and scatters of in-bounds, non-negative indices give what jnp's own
indexing gives, in a program (jit) as out of one, and their programs carry no bounds checks."""

import jax
import jax.numpy as jnp
import numpy as np

from model import indices


def _data():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((6, 4, 5)).astype(np.float32)
  idx = np.array([4, 0, 5, 2], np.int32)  # distinct, in bounds
  along = rng.integers(0, 5, (6, 4, 3)).astype(np.int32)
  return x, idx, along


def test_they_equal_jnps_indexing():
  x, idx, along = map(jnp.asarray, _data())
  y = jnp.full((4, 4, 5), 7.0, jnp.float32)

  def ours(x, idx, along, y):
    quotient, rest = indices.divmod_index(along * 13 + 5, 7)
    return (
      indices.take_rows(x, idx),
      indices.take_rows(x, (idx, 1, slice(None))),
      indices.put_rows(x, idx, y),
      indices.put_rows(x, (idx, 2), 0.0),
      indices.take_along(x, along, axis=2),
      quotient,
      rest,
    )

  def plain(x, idx, along, y):
    flat = along * 13 + 5
    return (
      x[idx],
      x[idx, 1, :],
      x.at[idx].set(y),
      x.at[idx, 2].set(0.0),
      jnp.take_along_axis(x, along, axis=2),
      flat // 7,
      flat % 7,
    )

  want = plain(x, idx, along, y)
  for got in (ours(x, idx, along, y), jax.jit(ours)(x, idx, along, y)):
    for a, b in zip(got, want):
      assert a.dtype == b.dtype
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_their_programs_have_no_bounds_checks():
  """jnp's gather of signed indices wraps negative ones (a compare and a select per index); these
  gathers are the bare XLA gather."""
  x, idx, _ = map(jnp.asarray, _data())
  ours = jax.jit(lambda x, i: indices.take_rows(x, i)).lower(x, idx).as_text()
  plain = jax.jit(lambda x, i: x[i]).lower(x, idx).as_text()
  assert "stablehlo.select" in plain and "stablehlo.compare" in plain
  assert "stablehlo.select" not in ours and "stablehlo.compare" not in ours
