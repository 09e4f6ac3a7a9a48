"""Continuous batching (model/pool.py, model/continuous.py) and the per-row decode indices it
needs (model/layers.py, model/transformer.py), on tiny random float32 models.

Every sentence of a list of mixed lengths, larger than the pool, must come out as the
batch-at-once search (model/decoder_state.py and model/search.py, what model/generate.py runs)
translates it: greedy, beam search with both length penalties, an ensemble, and every model type.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from model import cache as model_cache
from model import decoder_state
from model.build import build_model
from model.special_tokens import EOS_ID

EXTRA = 4  # max_extra_len
SOURCE_LEN = 32  # the bucket of every sentence below, as model/generate.py pads them
_lengths = np.random.default_rng(0).integers(2, 20, 11)
SENTENCES = [
  list(np.random.default_rng(int(n) + i).integers(3, 24, n - 1)) + [EOS_ID]
  for i, n in enumerate(_lengths)
]


@functools.cache
def tiny(kind="transformer", seed=0, eos_bias=2.0):
  """A tiny model of `kind` with random parameters, EOS's logit raised by `eos_bias` (so that
  some sentences stop before their length limit and others are cut there)."""
  cfg = dict(
    type=kind,
    vocab_size=24,
    d_model=32,
    d_ff=64,
    num_heads=4,
    num_layers=1,
    dropout_rate=0.0,
    share_embeddings=False,
  )
  model = build_model(cfg)
  ones = jnp.ones((1, 4), jnp.int32)
  params = nn.unbox(jax.jit(model.init)(jax.random.key(seed), ones, ones)["params"])
  params = jax.tree_util.tree_map(np.array, params)
  params["decoder"]["logits"]["bias"][EOS_ID] += eos_bias
  return model, params


def padded(sentences, width=SOURCE_LEN):
  out = np.zeros((len(sentences), width), np.int32)
  for i, s in enumerate(sentences):
    out[i, : len(s)] = s
  return out


# ----------------------------------------------------------------------------- per-row indices
def _cache(model, params, inputs, length):
  state = decoder_state.decoder_state(model, params, jnp.asarray(inputs), length, segment=None)
  return state.step, state.cache


def _per_row(carried, rows):
  return jax.tree_util.tree_map(lambda x: jnp.full((rows,), x) if x.ndim == 0 else x, carried)


def test_per_row_decode_indices_equal_the_shared_ones():
  """The Transformer's decode indices as [rows] vectors (all equal) give exactly the logits and
  caches of the shared scalar ones, step after step."""
  model, params = tiny()
  step, shared = _cache(model, params, padded(SENTENCES[:3]), 6)
  step = jax.jit(step)
  leaves = jax.tree_util.tree_leaves(shared[model_cache.STATE])
  assert leaves and all(x.ndim == 0 for x in leaves)  # today's path: scalars
  rows = _per_row(shared, 3)
  for token in (0, 7, 12, 5):
    ids = jnp.full((3, 1), token, jnp.int32)
    want, shared = step(ids, shared)
    got, rows = step(ids, rows)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    jax.tree_util.tree_map(
      lambda r, s: np.testing.assert_array_equal(r, np.broadcast_to(s, r.shape)), rows, shared
    )


def test_rows_at_different_steps_each_continue_their_own_prefix():
  """A cache whose rows come from searches at different steps (each row its own index and
  position) continues every row exactly as its own search does."""
  model, params = tiny()
  inputs = padded(SENTENCES[:3])
  step, first = _cache(model, params, inputs, 8)
  step = jax.jit(step)
  tokens = np.array([[0, 9, 4, 13, 7], [0, 5, 5, 21, 3], [0, 17, 8, 6, 11]], np.int32)
  caches, logits = [first], []
  for t in range(tokens.shape[1]):
    out, nxt = step(jnp.asarray(tokens[:, t : t + 1]), caches[-1])
    caches.append(nxt)
    logits.append(np.asarray(out))
  at = [3, 1, 4]  # row r continues from step at[r]
  # Row r of the cache after at[r] steps; the scalar counters become [rows] vectors.
  row = lambda x, r: x[r] if x.ndim else x
  mixed = jax.tree_util.tree_map(
    lambda *xs: jnp.stack([row(xs[t], r) for r, t in enumerate(at)]), *caches
  )
  ids = jnp.asarray(tokens[np.arange(3), at][:, None])
  got, _ = step(ids, mixed)
  for r, t in enumerate(at):
    np.testing.assert_array_equal(np.asarray(got)[r], logits[t][r])
