"""Beam search with the self-attention buffers kept in place (model/ancestry.py): every step reads
each row's history as reordered buffers would hold it, so the search is beam search with
`gather_beams` to the last bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.common import base_config
from model import ancestry, beam_pieces, cache_kinds, search
from model.build import abstract_params, build_model
from model.decoder_state import decoder_state, ensemble_decoder_state
from model.generate import generate
from model.search_settings import SearchSettings
from model.token_step import output_limits
from tests.test_generate import EXTRA, SOURCES, padded, random_model

SEGMENT = 4  # buffers grow 4 -> 8 -> 16 within these short outputs
MAX_LEN = 12 + EXTRA


def test_the_table_reads_each_row_its_reordered_history():
  """A toy cache (one buffer, a shared counter) whose step writes each row's own mark and returns
  every position it can see: through the table it sees what reordered buffers hold, step after
  step of random reorders, while the buffer itself never moves a row."""
  batch, beam, length = 2, 3, 6
  rows = batch * beam

  def step(ids, carried):
    i = carried[cache_kinds.STATE]["i"]
    buf = carried[cache_kinds.TARGET]["k"]
    mark = (ids[:, :1] * 100 + jnp.arange(rows)[:, None]).astype(jnp.float32)[:, None, :, None]
    buf = jax.lax.dynamic_update_slice_in_dim(buf, mark, i, axis=-2)
    seen = jnp.where(jnp.arange(length) <= i, buf[:, 0, :, 0], -1.0)
    out = {cache_kinds.STATE: {"i": i + 1}, cache_kinds.TARGET: {"k": buf}}
    return seen, out

  carried = {
    cache_kinds.STATE: {"i": np.int32(0)},
    cache_kinds.TARGET: {"k": np.zeros((rows, 1, length, 1), np.float32)},
  }
  assert ancestry.applies(carried)
  in_place = ancestry.in_place_step(step)

  @jax.jit  # one step of both searches: compiled once, run `length` times
  def both(moved, kept, ids, parents):
    (want, moved), (got, kept) = step(ids, moved), in_place(ids, kept)
    moved = search.gather_beams(moved, parents, batch, beam)
    kept = ancestry.reorder(kept, parents, batch, beam)
    return want, got, moved, kept

  moved, kept = carried, ancestry.with_table(carried)
  rng = np.random.default_rng(0)
  for t in range(length):
    ids = rng.integers(1, 9, (rows, 1)).astype(np.int32)
    parents = rng.integers(0, beam, (batch, beam)).astype(np.int32)
    want, got, moved, kept = both(moved, kept, ids, parents)
    np.testing.assert_array_equal(got, want)
    # Position t of the kept buffer holds what row r itself wrote there.
    written = np.asarray(kept[cache_kinds.TARGET]["k"])[:, 0, t, 0] % 100
    np.testing.assert_array_equal(written, np.arange(rows))


SETTINGS = {
  "gnmt-exact": dict(beam_size=3, alpha=0.6, penalty="gnmt", stopping="exact"),
  "fairseq-finished": dict(beam_size=4, alpha=1.0, penalty="fairseq", stopping="finished"),
}


@pytest.mark.parametrize(
  "name, how",
  [
    ("gnmt-exact", "plain"),
    ("gnmt-exact", "prefixed"),
    ("fairseq-finished", "plain"),
    ("fairseq-finished", "ensemble"),
  ],
)
def test_beam_search_in_place_is_beam_search_to_the_last_bit(name, how):
  """A random Transformer's beam search (or an ensemble of two), buffers grown segment by
  segment: ids, scores, token scores and steps equal to the last bit with the buffers reordered
  every step."""
  # One layer (two buffers, k and v), EOS pushed up so that some hypotheses end within 3 steps
  # and others run to their limits (up to 16 steps: the buffers grow 4 -> 8 -> 16).
  model, params = random_model(num_layers=1, seed=3, eos_bias=4.6)
  inputs = padded(SOURCES)
  prefixed = how == "prefixed"
  prefix = padded([[7, 5], [9], [], [4, 4, 4], [], [11], [6, 8], []], 3) if prefixed else None
  limits = output_limits(inputs, prefix, EXTRA)
  if how == "ensemble":
    other = random_model(num_layers=1, seed=9, eos_bias=4.0)[1]
    params = jax.tree_util.tree_map(lambda a, b: np.stack([a, b]), params, other)
  applies = []

  @jax.jit  # the encoding and both searches: one program
  def both(params):
    if how == "ensemble":
      state = ensemble_decoder_state(model, params, inputs, MAX_LEN, SEGMENT)
    else:
      state = decoder_state(model, params, inputs, MAX_LEN, segment=SEGMENT)
    applies.append(ancestry.applies(state.cache))
    kept = state._replace(
      step=ancestry.in_place_step(state.step), cache=ancestry.with_table(state.cache)
    )
    return [run(state, None), run(kept, ancestry.reorder)]

  def run(state, reorder):
    return search.beam_search(
      state.step,
      state.cache,
      inputs.shape[0],
      MAX_LEN,
      **SETTINGS[name],
      max_lens=limits,
      grow=state.grow,
      segment=state.segment,
      token_scores=True,
      count_steps=True,
      prefix=None if prefix is None else jnp.asarray(prefix),
      reorder=reorder,
    )

  want, got = both(params)
  assert applies == [True]
  assert len(got) == len(want) == 4
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("kind", ["rnn", "decoder_only"])
def test_only_caches_written_at_one_shared_position_are_kept_in_place(kind):
  """A recurrent state has no buffers to keep; a decoder-only model's rows write at their own
  positions (per-row counters): both are reordered as before."""
  cfg = base_config().model
  cfg.update(dict(type=kind, vocab_size=24, d_model=16, d_ff=32, num_heads=2, num_layers=1))
  model = build_model(cfg)
  inputs = padded(SOURCES[:2])
  cache = jax.eval_shape(  # the cache's leaves' shapes: all `applies` reads
    lambda p: decoder_state(model, p, inputs, MAX_LEN, segment=SEGMENT).cache, abstract_params(cfg)
  )
  assert not ancestry.applies(cache)


@pytest.mark.parametrize("beam_size, kept", [(3, True), (1, False)])
def test_generate_and_the_pieces_keep_a_transformers_buffers_in_place(monkeypatch, beam_size, kept):
  """`generate`'s beam search reads through the table (greedy search has nothing to reorder), and
  a piece of the merged search carries it from its start (traced only)."""
  model, params = random_model(num_layers=1, seed=2, eos_bias=3.4)
  inputs = padded(SOURCES[:2])
  settings = SearchSettings(beam_size=beam_size, max_extra_len=EXTRA)
  wrapped = []
  real = ancestry.in_place_step
  monkeypatch.setattr(ancestry, "in_place_step", lambda step: wrapped.append(1) or real(step))
  jax.eval_shape(lambda p: generate(model, p, inputs, None, settings, MAX_LEN), params)
  assert bool(wrapped) == kept
  if kept:
    piece, _ = jax.eval_shape(
      lambda p: beam_pieces.begin(model, p, inputs, settings, MAX_LEN, 4, segment=SEGMENT), params
    )
    assert ancestry.kept_in_place(piece.state.cache)
