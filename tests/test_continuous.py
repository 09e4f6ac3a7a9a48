"""Continuous batching (model/pool.py, inference/continuous.py) and the per-row decode indices it
needs (model/layers.py, model/transformer.py), on tiny random float32 models.

Every sentence of a list of mixed lengths, larger than the pool, must come out as the
batch-at-once search (model/decoder_state.py and model/search.py, what model/generate.py runs)
translates it: greedy, beam search with both length penalties, an ensemble, and every model type.
"""

import functools

import jax
import numpy as np
import pytest
from flax import linen as nn

from inference import continuous, generator
from model import cache_kinds, decoder_state, generate
from model.build import build_model
from model.search_settings import SearchSettings
from model.special_tokens import EOS_ID
from tests.helpers import Compilations

EXTRA = 4  # max_extra_len
SOURCE_LEN = 32  # the bucket of every sentence below, as model/generate.py pads them
_lengths = np.random.default_rng(0).integers(2, 20, 11)
SENTENCES = [
  list(np.random.default_rng(int(n) + i).integers(3, 24, n - 1)) + [EOS_ID]
  for i, n in enumerate(_lengths)
]


# Per model type, the random parameters' (seed, eos_bias) for which the outputs below vary between
# sentences and some stop at EOS before their length limit while others are cut there.
SETUPS = {
  "transformer": (1, 2.0),
  "rnn": (3, 0.0),
  "rnn_attention": (0, 0.0),
  "decoder_only": (1, 1.5),
}


@functools.cache
def tiny(kind="transformer", seed=None):
  """A tiny model of `kind` with random parameters (`SETUPS`, or another `seed`)."""
  seed, eos_bias = (SETUPS[kind][0] if seed is None else seed), SETUPS[kind][1]
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
  ones = np.ones((1, 4), np.int32)
  shapes = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), ones, ones)["params"])
  rng = np.random.default_rng(seed)

  def leaf(path, x):  # Xavier-like matrices, biases well away from 0: outputs vary a lot
    name = path[-1].key
    if name == "scale":
      return np.ones(x.shape, np.float32)
    if name.endswith("bias"):
      return (0.5 * rng.standard_normal(x.shape)).astype(np.float32)
    fan_in = x.shape[-2] if len(x.shape) > 1 and name != "kernel" else x.shape[0]
    return (rng.standard_normal(x.shape) / np.sqrt(fan_in)).astype(np.float32)

  params = jax.tree_util.tree_map_with_path(leaf, shapes)
  params["decoder"]["logits"]["bias"][EOS_ID] += eos_bias
  return model, params


def padded(sentences, width=SOURCE_LEN):
  out = np.zeros((len(sentences), width), np.int32)
  for i, s in enumerate(sentences):
    out[i, : len(s)] = s
  return out


# ----------------------------------------------------------------------------- per-row indices
DECODE_LEN = 8  # the self-attention buffers of the decoder states below


@functools.cache
def _decoder():
  """(step, cache) of model/decoder_state.py's `decoder_state` of the Transformer over
  SENTENCES[:3] (buffers for DECODE_LEN positions, no segments): the cache it starts from and its
  step function, each one program for the whole module (the step builds the same state from the
  parameters and sources, then steps it)."""
  model, params = tiny()
  inputs = padded(SENTENCES[:3])

  def state(p, x):
    return decoder_state.decoder_state(model, p, x, DECODE_LEN, segment=None)

  cache = jax.jit(lambda p, x: state(p, x).cache)(params, inputs)
  step = jax.jit(lambda p, x, ids, carried: state(p, x).step(ids, carried))
  return functools.partial(step, params, inputs), cache


def _per_row(carried, rows):
  return jax.tree_util.tree_map(lambda x: np.full((rows,), x) if x.ndim == 0 else x, carried)


def test_per_row_decode_indices_equal_the_shared_ones():
  """The Transformer's decode indices as [rows] vectors (all equal) give exactly the logits and
  caches of the shared scalar ones, step after step."""
  step, shared = _decoder()
  leaves = jax.tree_util.tree_leaves(shared[cache_kinds.STATE])
  assert leaves and all(x.ndim == 0 for x in leaves)  # today's path: scalars
  rows = _per_row(shared, 3)
  for token in (0, 7, 12, 5):
    ids = np.full((3, 1), token, np.int32)
    want, shared = step(ids, shared)
    got, rows = step(ids, rows)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    jax.tree_util.tree_map(
      lambda r, s: np.testing.assert_array_equal(r, np.broadcast_to(s, r.shape)), rows, shared
    )


def test_rows_at_different_steps_each_continue_their_own_prefix():
  """A cache whose rows come from searches at different steps (each row its own index and
  position) continues every row exactly as its own search does."""
  step, first = _decoder()
  tokens = np.array([[0, 9, 4, 13, 7], [0, 5, 5, 21, 3], [0, 17, 8, 6, 11]], np.int32)
  caches, logits = [first], []
  for t in range(tokens.shape[1]):
    out, nxt = step(tokens[:, t : t + 1], caches[-1])
    caches.append(nxt)
    logits.append(np.asarray(out))
  caches = jax.tree_util.tree_map(np.asarray, caches)  # rows taken on the host
  at = [3, 1, 4]  # row r continues from step at[r]
  # Row r of the cache after at[r] steps; the scalar counters become [rows] vectors.
  row = lambda x, r: np.asarray(x[r] if x.ndim else x)
  mixed = jax.tree_util.tree_map(
    lambda *xs: np.stack([row(xs[t], r) for r, t in enumerate(at)]), *caches
  )
  ids = tokens[np.arange(3), at][:, None]
  got, _ = step(ids, mixed)
  for r, t in enumerate(at):
    np.testing.assert_array_equal(np.asarray(got)[r], logits[t][r])


# ----------------------------------------------------------------------------- the pool
_GENERATORS: dict = {}  # this module's batch searches: one Generator per (model, ensemble)


def _generator(model, ensemble=False):
  if (model, ensemble) not in _GENERATORS:
    _GENERATORS[model, ensemble] = generator.Generator(model, ensemble=ensemble)
  return _GENERATORS[model, ensemble]


def batch_at_once(model, params, ensemble=False, **settings):
  """Each sentence's best translation (no EOS) by model/generate.py's batch-at-once search."""
  settings = SearchSettings(max_extra_len=EXTRA, **settings)
  outputs = _generator(model, ensemble).translate_all(params, SENTENCES, settings)
  return [o.tolist() for o in outputs]


def batch_nbest(model, params, **settings):
  """Each sentence's `NBest` by the batch-at-once search: all beam_size hypotheses, best first,
  with their scores and per-token log-probabilities."""
  settings = SearchSettings(max_extra_len=EXTRA, **settings)
  every = settings.replace(num_hypotheses=settings.beam_size)
  return _generator(model).translate_all(params, SENTENCES, every, token_scores=True)


def batch_best(model, params, **settings):
  """Each sentence's best translation (no EOS) by the batch-at-once search of `batch_nbest`."""
  return [found.ids[0].tolist() for found in batch_nbest(model, params, **settings)]


POOLS = continuous.PoolPrograms()  # this module's compiled pools, shared by its tests


def pooled(model, params, sentences=SENTENCES, settings=None, **options):
  """The same through a pool of 3 sentences (fewer than the list's)."""
  if settings is None:
    options.setdefault("max_extra_len", EXTRA)
  options = dict(pool_size=3, programs=POOLS) | options
  outputs = continuous.translate_continuous(model, params, sentences, settings, **options)
  return [o.tolist() for o in outputs]


SEARCHES = {
  "greedy": dict(beam_size=1),
  "beam-gnmt": dict(beam_size=3, alpha=0.6),
  "beam-fairseq": dict(beam_size=3, alpha=1.0, length_penalty="fairseq"),
  "beam-gnmt-finished": dict(beam_size=3, alpha=2.0, stopping="finished"),
  "beam-fairseq-exact": dict(beam_size=3, alpha=1.0, length_penalty="fairseq", stopping="exact"),
}


@pytest.mark.parametrize("how", list(SEARCHES))
def test_each_sentence_translates_and_scores_as_in_a_batch(how):
  """Every sentence comes out of the pool once, its hypotheses (the best first) the batch-at-once
  search's, and with `token_scores=True` their scores and per-token log-probabilities the same
  as the batch-at-once search returns (greedy search and beam search with both length penalties
  and each stopping rule, all of the beam's hypotheses)."""
  model, params = tiny()
  settings = SearchSettings(max_extra_len=EXTRA, **SEARCHES[how])
  batch = batch_nbest(model, params, **SEARCHES[how])
  finished = list(
    continuous.decode_continuous(
      model,
      params,
      SENTENCES,
      settings,
      source_len=SOURCE_LEN,
      pool_size=3,
      token_scores=True,
      programs=POOLS,
    )
  )
  assert sorted(done.index for done in finished) == list(range(len(SENTENCES)))
  for done in finished:  # each hypothesis, the best first, is the batch's
    want = batch[done.index]
    assert [generate.strip(row).tolist() for row in done.ids] == [h.tolist() for h in want.ids]
    np.testing.assert_allclose(done.scores, want.scores, rtol=1e-5, atol=1e-5)
    for row, tokens in zip(done.token_scores, want.token_scores):
      np.testing.assert_allclose(row[: len(tokens)], tokens, rtol=1e-5, atol=1e-5)
      assert not row[len(tokens) :].any()


def test_the_list_is_not_degenerate():
  """The outputs the tests compare differ between sentences and searches (the stopping rules
  too), and some sentences stop at EOS before their length limit while others are cut there."""
  model, params = tiny()
  greedy = batch_best(model, params, **SEARCHES["greedy"])
  beam = batch_best(model, params, **SEARCHES["beam-gnmt"])
  assert len({tuple(o) for o in greedy}) >= 6 and greedy != beam
  for how, other in (("beam-gnmt-finished", "exact"), ("beam-fairseq-exact", "finished")):
    rule = dict(SEARCHES[how], stopping=other)
    assert batch_best(model, params, **SEARCHES[how]) != batch_best(model, params, **rule)
  natural = [len(o) + 1 < len(s) + EXTRA for o, s in zip(greedy, SENTENCES)]
  assert any(natural) and not all(natural), natural


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["rnn", "rnn_attention", "decoder_only"])
def test_every_model_type_translates_as_in_a_batch(kind):
  """The recurrent models' states and the decoder-only model's prefilled rows (already per row)
  go through the pool as the Transformer's cache does."""
  model, params = tiny(kind)
  how = SEARCHES["beam-gnmt"]
  want = batch_at_once(model, params, **how)
  assert len({tuple(o) for o in want}) >= 7, want
  assert pooled(model, params, **how) == want


@pytest.mark.slow
def test_an_ensemble_translates_as_in_a_batch():
  """Two different models' parameters stacked (ensemble=True): each member reads its own
  caches in the pool, as in the batch."""
  model, first = tiny()
  _, second = tiny(seed=3)
  both = jax.tree_util.tree_map(lambda a, b: np.stack([a, b]), first, second)
  how = SEARCHES["beam-fairseq"]
  want = batch_at_once(model, both, ensemble=True, **how)
  assert want != batch_best(model, first, **how)
  assert pooled(model, both, ensemble=True, **how) == want


def test_a_mismatched_ensemble_is_refused_by_name():
  """Members whose leaves disagree on the member axis: the pool and the batch search both raise
  `distribution.members`' error (no raw vmap error), before compiling anything."""
  model, first = tiny()
  both = jax.tree_util.tree_map(lambda a: np.stack([a, a]), first)
  both["decoder"]["logits"]["bias"] = np.stack([first["decoder"]["logits"]["bias"]] * 3)
  for run in (
    lambda: pooled(model, both, ensemble=True, beam_size=1),
    lambda: batch_at_once(model, both, ensemble=True, beam_size=1),
  ):
    with pytest.raises(ValueError, match=r"ensemble: every parameter needs the same leading"):
      run()


def test_sampling_reproduces_itself_whatever_the_pool():
  """A sentence's samples depend on the key and its index alone: the same with another pool
  size; another key draws others; top_k=1 is greedy search."""
  model, params = tiny()
  how = dict(temperature=1.0, rng=jax.random.key(7))
  first = pooled(model, params, **how)
  assert pooled(model, params, **how) == first
  assert pooled(model, params, pool_size=5, **how) == first
  assert pooled(model, params, temperature=1.0, rng=jax.random.key(8)) != first
  greedy = batch_best(model, params, **SEARCHES["greedy"])
  assert first != greedy
  assert pooled(model, params, temperature=1.5, top_k=1) == greedy


@pytest.mark.slow
def test_sampling_draws_from_the_model_distribution():
  """The first tokens sampled for 400 copies of one sentence (each its own noise) follow the
  model's first-step distribution at that temperature."""
  model, params = tiny()
  sentence, temperature = SENTENCES[0], 1.0
  outputs = pooled(model, params, [sentence] * 400, pool_size=5, temperature=temperature)
  first = np.bincount([o[0] if o else EOS_ID for o in outputs], minlength=24) / 400
  step, cache = _decoder()  # its row 0 is `sentence`
  logits, _ = step(np.zeros((3, 1), np.int32), cache)
  logits = np.asarray(logits, np.float64)[0] / temperature
  want = np.exp(logits - logits.max())
  want /= want.sum()
  assert np.abs(first - want).max() < 0.06, (first.round(3), want.round(3))
  assert (want > 0.05).sum() >= 3  # several likely first tokens: the test can tell


def test_one_program_serves_every_list_and_few_steps_per_call_change_nothing():
  """Lists of other lengths and sizes (sources in the same bucket) reuse the compiled program
  their `PoolPrograms` keeps (a call without one compiles its own); device calls of at most 2
  steps, handed one sentence at a time, give the same outputs."""
  model, params = tiny()
  how = dict(SEARCHES["beam-gnmt"], token_scores=True)  # a program of the tests above
  with Compilations("jit(advance)") as compiled:
    whole = pooled(model, params, **how)
    first = compiled.count  # 1, or 0 where this process compiled the same program before
    assert first <= 1
    pooled(model, params, SENTENCES[2:7], **how)
    pooled(model, params, SENTENCES[:1] * 9, **how)
  assert compiled.count == first
  with Compilations("jit(advance)") as compiled:
    pooled(model, params, SENTENCES[2:7], programs=continuous.PoolPrograms(), **how)
  assert compiled.count == 1
  assert pooled(model, params, max_steps=2, queue_size=1, **how) == whole


def test_streamed_sentences_come_out_with_their_index_and_scores():
  """`decode_continuous` reads an iterator lazily and yields each sentence when done, its
  index, its hypotheses and their scores, best first."""
  model, params = tiny()
  settings = SearchSettings(max_extra_len=EXTRA, **SEARCHES["beam-gnmt"])
  options = dict(pool_size=3, token_scores=True, programs=POOLS)  # test_each_...'s program
  best, seen = pooled(model, params, settings=settings, **options), []
  for done in continuous.decode_continuous(
    model, params, iter(SENTENCES), settings, source_len=SOURCE_LEN, **options
  ):
    assert done.ids.shape == (3, SOURCE_LEN + EXTRA) and done.scores.shape == (3,)
    assert np.all(np.diff(done.scores) <= 0) and np.isfinite(done.scores[0])
    seen.append(done.index)
    assert generate.strip(done.ids[0]).tolist() == best[done.index]
  assert sorted(seen) == list(range(len(SENTENCES))) and seen != sorted(seen)


def test_bad_arguments_are_named():
  model, params = tiny()
  for settings, match in (
    (dict(source_len=8), r"sentences\[0\]: 17 tokens, more than source_len=8"),
    (dict(length_penalty="wu"), "length_penalty='wu'"),
    (dict(pool_size=0), "pool_size=0"),
    (dict(num_ids=1), "num_ids=1"),
    (dict(max_steps=0), "max_steps=0"),
    (dict(beam=3), "beam=...: not a setting"),
  ):
    with pytest.raises(ValueError, match=match):
      continuous.translate_continuous(model, params, SENTENCES, **settings)
  with pytest.raises(ValueError, match="pool_size=0"):  # when called, before any sentence is read
    continuous.decode_continuous(model, params, iter(()), source_len=8, pool_size=0)
  assert continuous.translate_continuous(model, params, []) == []
