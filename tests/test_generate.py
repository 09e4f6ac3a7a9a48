"""Tests for model/generate.py and inference/generator.py on a random tiny Transformer (no
checkpoint needed).

The random parameters (numpy, no init compilation) are picked so that greedy outputs differ
between sentences, beam search differs from greedy, and some sentences stop at EOS before their
length limit while others are cut there. Compilations dominate the run time on CPU, so the
tests share few shapes.
"""

import dataclasses
import os
import re
import threading

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import traverse_util

from inference import attention_weights, generator
from inference.generator import Generator
from inference.program_store import ProgramStore
from model import cache_kinds, decoder_state, generate, length_buckets
from model.build import abstract_params, build_model
from model.decoder_state import DECODE_SEGMENT
from model.search_settings import STOPPING, SearchSettings, with_keywords
from tests.helpers import Compilations

PAD, EOS = 0, 1
EXTRA = 4  # max_extra_len
SRC_LEN = 12  # padded source width of the whole-batch calls
# Source ids (EOS included) of mixed lengths: two in the 8-token bucket, six in the 12 one.
SOURCES = [
  [5, 9, 7, EOS],
  [4, 11, 23, 8, 6, 13, 17, 9, 5, EOS],
  [12, 20, 7, 7, 15, 22, 3, 9, 11, 10, EOS],
  [21, 6, 18, 9, 4, 10, 14, 16, 5, EOS],
  [8, 16, 22, 5, 19, 11, 7, 13, 6, 20, 9, EOS],
  [10, 4, 6, 12, EOS],
  [14, 15, 16, 17, 18, 19, 20, 21, 22, EOS],
  [9, 8, 7, 6, 5, 4, 23, 22, 21, 20, 19, EOS],
]


def random_model(num_layers: int, seed: int, eos_bias: float, max_len: int = 64):
  """A tiny Transformer and random (numpy) parameters; `eos_bias` is added to EOS's logit."""
  cfg = ml_collections.ConfigDict(
    dict(
      type="transformer",
      vocab_size=24,
      d_model=32,
      d_ff=64,
      num_heads=4,
      num_layers=num_layers,
      dropout_rate=0.0,
      max_len=max_len,
      share_embeddings=False,
    )
  )
  rng = np.random.default_rng(seed)
  flat = {}
  for path, leaf in traverse_util.flatten_dict(abstract_params(cfg)).items():
    shape = leaf.shape
    if path[-1] == "scale":
      flat[path] = np.ones(shape, np.float32)
    elif path[-1] == "bias":
      flat[path] = 0.5 * rng.standard_normal(shape, np.float32)
    elif path[-1] == "embedding":
      flat[path] = rng.standard_normal(shape, np.float32) / np.sqrt(shape[-1])
    else:  # Glorot uniform
      fan_in = int(np.prod(shape[:-1])) if path[-2] == "out" else shape[0]
      limit = np.sqrt(6 / (fan_in + int(np.prod(shape)) // fan_in))
      flat[path] = rng.uniform(-limit, limit, shape).astype(np.float32)
  flat[("decoder", "logits", "bias")][EOS] += eos_bias
  return build_model(cfg), traverse_util.unflatten_dict(flat)


@pytest.fixture(scope="module")
def tiny():
  return random_model(num_layers=1, seed=2, eos_bias=3.4)


_GENERATORS: dict = {}  # this module's generators, one per (model, options): compiles dominate


class _Translate:
  """`inference.generator.translate` and `translate_all`, but through one kept `Generator` per
  (model, options), as a caller decoding repeatedly holds one."""

  DEFAULTS = dict(num_ids=None, ensemble=False, use_cache=True, segment=DECODE_SEGMENT)

  @staticmethod
  def _generator(model, options):
    own = {k: options.pop(k) for k in _Translate.DEFAULTS if k in options}
    # Keyed by every option's value: an option given at its default is the default generator.
    key = (model, tuple(sorted({**_Translate.DEFAULTS, **own}.items())))
    if key not in _GENERATORS:
      _GENERATORS[key] = Generator(model, **own)
    return _GENERATORS[key]

  def translate(self, model, params, inputs, settings=None, *, rng=None, max_decode_len=None, **o):
    settings, o = with_keywords(settings, o)
    return self._generator(model, o)(
      params, inputs, settings, rng=rng, max_decode_len=max_decode_len
    )

  def translate_all(self, model, params, token_lists, settings=None, **o):
    settings, o = with_keywords(settings, o)
    return self._generator(model, o).translate_all(params, token_lists, settings, **o)


kept = _Translate()


def padded(sources, width=SRC_LEN):
  out = np.zeros((len(sources), width), np.int32)
  for i, s in enumerate(sources):
    out[i, : len(s)] = s
  return out


@pytest.fixture(scope="module")
def reference(tiny):
  """Greedy translation of each sentence alone, by a plain Python loop that re-runs the whole
  model on the prefix: argmax over non-PAD tokens, EOS forced at src_len + EXTRA tokens."""
  model, params = tiny
  logits_fn = jax.jit(lambda p, i, t: model.apply({"params": p}, i, t))
  width = SRC_LEN + EXTRA
  outputs = []
  for src in SOURCES:
    out = []
    while not out or out[-1] != EOS:
      targets = np.full((1, width), EOS, np.int32)  # filler after the prefix: not padding
      targets[0, : len(out)] = out
      logits = np.array(logits_fn(params, padded([src]), targets))[0, len(out)]
      logits[PAD] = -np.inf
      out.append(EOS if len(out) + 1 >= len(src) + EXTRA else int(np.argmax(logits)))
    outputs.append(out)
  return outputs


def rows(ids):
  """[batch, length] -> per row the tokens up to and including EOS."""
  result = []
  for row in np.asarray(ids).tolist():
    result.append(row[: row.index(EOS) + 1] if EOS in row else row)
  return result


def test_reference_is_not_degenerate(reference):
  assert len({tuple(r) for r in reference}) >= 4, reference
  assert len(set(sum(reference, []))) >= 4, reference
  natural = [len(r) < len(s) + EXTRA for r, s in zip(reference, SOURCES)]
  assert any(natural) and not all(natural), "want both natural and forced EOS"


def test_greedy_cached_and_uncached_match_reference(tiny, reference):
  model, params = tiny
  inputs = padded(SOURCES)
  for use_cache in (True, False):
    ids = kept.translate(
      model, params, inputs, beam_size=1, max_extra_len=EXTRA, use_cache=use_cache
    )
    assert ids.shape == (len(SOURCES), SRC_LEN + EXTRA)
    assert rows(ids) == reference, f"use_cache={use_cache}"
    # PAD after EOS only.
    for row, ref in zip(np.asarray(ids), reference):
      assert (row[len(ref) :] == PAD).all()


def test_sinusoidal_positions_decode_past_max_len(reference):
  """The Transformer's sinusoidal positions have no limit: with `model.max_len` = 8 the cached
  greedy search still places targets of up to 16 tokens, exactly as the model with max_len 64
  (same parameters) does."""
  model, params = random_model(num_layers=1, seed=2, eos_bias=3.4, max_len=8)
  ids = kept.translate(model, params, padded(SOURCES), beam_size=1, max_extra_len=EXTRA)
  assert max(len(r) for r in reference) > 8
  assert rows(ids) == reference


def test_beam_cached_equals_uncached(tiny):
  model, params = tiny
  inputs = padded(SOURCES)
  cached = kept.translate(model, params, inputs, beam_size=2, max_extra_len=EXTRA)
  uncached = kept.translate(
    model, params, inputs, beam_size=2, max_extra_len=EXTRA, use_cache=False
  )
  np.testing.assert_array_equal(cached, uncached)
  assert rows(cached) != rows(
    kept.translate(model, params, inputs, beam_size=1, max_extra_len=EXTRA)
  )
  for out, src in zip(rows(cached), SOURCES):  # per-sentence limit: src_len + EXTRA, EOS included
    assert out[-1] == EOS and len(out) <= len(src) + EXTRA


@pytest.mark.slow
def test_growing_cache_changes_nothing(tiny):
  """Self-attention buffers grown 3 positions at a time (several compiled loop segments) give
  exactly the translations of buffers allocated for the whole output, greedy and beam (those of
  the default segment, which at this output width allocates the whole output at once: the
  programs the other tests compile)."""
  model, params = tiny
  inputs = padded(SOURCES)
  width = SRC_LEN + EXTRA

  def state_of(segment):
    """(grow, segment) of the decoder state, traced only (built eagerly, its encoder would
    compile op by op)."""
    seen = []

    def cache(p, x):
      state = decoder_state.decoder_state(model, p, x, width, segment=segment)
      seen.append((state.grow, state.segment))
      return state.cache

    jax.eval_shape(cache, params, inputs)
    return seen[0]

  assert state_of(DECODE_SEGMENT) == (None, None)  # the whole output allocated at once
  grow, segment = state_of(3)
  assert segment == 3 and grow is not None
  for beam in (1, 2):
    whole = kept.translate(model, params, inputs, beam_size=beam, max_extra_len=EXTRA)
    grown = kept.translate(model, params, inputs, beam_size=beam, max_extra_len=EXTRA, segment=3)
    np.testing.assert_array_equal(grown, whole, err_msg=f"beam {beam}")
  with pytest.raises(ValueError, match="segment"):
    kept.translate(model, params, inputs, segment=0)


def test_length_batches_cover_every_sentence_once():
  lists = [[7] * n for n in (1, 30, 5, 9, 9, 16, 17, 3, 0, 8, 100)]
  batches = length_buckets.length_batches(lists, tokens_per_batch=64, batch_multiple=2)
  seen = np.concatenate([b.indices for b in batches])
  assert sorted(seen.tolist()) == list(range(len(lists)))
  for b in batches:
    n_rows, length = b.inputs.shape
    assert n_rows % 2 == 0 and n_rows >= len(b.indices)
    assert n_rows * length <= 64 or n_rows == 2
    assert length == length_buckets.bucket_length(max(len(lists[i]) for i in b.indices))
    for row, i in enumerate(b.indices):
      assert b.inputs[row].tolist() == lists[i] + [0] * (length - len(lists[i]))
  # One shape per length bucket (32, 128).
  assert len({b.inputs.shape for b in batches}) == 2, [b.inputs.shape for b in batches]
  # max_rows caps the rows as a smaller tokens_per_batch would: the same batches.
  capped = length_buckets.length_batches(lists * 9, tokens_per_batch=4096, max_rows=4)
  small = length_buckets.length_batches(lists * 9, tokens_per_batch=4 * 32)
  of = lambda batches, width: [
    (b.indices.tolist(), b.inputs.tolist()) for b in batches if b.inputs.shape[1] == width
  ]
  assert {b.inputs.shape for b in capped} == {(4, 32), (3, 128)}  # 90 and 9 sentences
  assert of(capped, 32) == of(small, 32)
  assert [length_buckets.bucket_length(n) for n in (0, 8, 32, 33, 64, 65, 100)] == [
    32,
    32,
    32,
    64,
    64,
    128,
    128,
  ]
  assert [length_buckets.round_rows(n) for n in (1, 2, 3, 5, 7, 9, 13, 100)] == [
    1,
    2,
    3,
    6,
    8,
    12,
    16,
    128,
  ]


@pytest.mark.slow
def test_a_file_compiles_one_program_per_length_bucket(tiny):
  """A file-like mix (300 sentences of 3..40 tokens, Multi30k's spread): two length buckets,
  one compilation per piece of a bucket's search (inference/merged_search.py: the 32 bucket's
  many batches pause at step 16, the 64 bucket's one batch is searched whole), batches decoded
  at once the same, and each sentence's translation the one it gets alone."""
  model, params = tiny
  rng = np.random.default_rng(0)
  lengths = np.clip(rng.normal(15, 6, 300).round().astype(int), 3, 40)
  lists = [list(rng.integers(3, 24, n - 1)) + [EOS] for n in lengths]
  batches = length_buckets.length_batches(lists, tokens_per_batch=512)
  assert len(batches) > 5 and len({b.inputs.shape for b in batches}) == 2
  how = dict(beam_size=2, max_extra_len=EXTRA + 1)  # settings no other test compiles
  with Compilations("jit(_piece)") as compiled:
    outputs = kept.translate_all(model, params, lists, tokens_per_batch=512, **how)
  assert compiled.count == 3
  with Compilations("jit(_piece)") as again:  # batches decoded at once: the same, in order
    parallel = kept.translate_all(
      model, params, lists, tokens_per_batch=512, parallel_batches=3, **how
    )
  assert again.count == 0
  assert [o.tolist() for o in parallel] == [o.tolist() for o in outputs]
  for i in (0, 1, 150, 299):  # a sentence alone in its batch decodes to the same tokens
    alone = np.asarray(kept.translate(model, params, padded([lists[i]], 64), **how))
    assert outputs[i].tolist() == generate.strip(alone[0]).tolist(), i


def test_translate_all_counts_the_rows_searched_against_those_needed(tiny):
  """`Generator.rows_searched` (`--verbosity=1` logs it): a sentence's rows times the steps
  it searched before it was done are what it needs, the same in a batch as alone; a batch
  searches its rows for as many steps as its longest search (issue 54)."""
  model, params = tiny
  lists = [SOURCES[0], SOURCES[1], SOURCES[2]]
  how = dict(beam_size=2, max_extra_len=EXTRA + 1, tokens_per_batch=512)
  generator = kept._generator(model, {})
  alone = []
  for sentence in lists:  # batches of one row: what is searched is what is needed
    kept.translate_all(model, params, [sentence], **how)
    computed, needed = generator.rows_searched
    assert computed == needed > 0 and needed % 2 == 0
    alone.append(needed // 2)  # the sentence's steps
  assert len(set(alone)) > 1  # sentences that stop at different steps
  kept.translate_all(model, params, lists, **how)  # one batch of 3
  assert generator.rows_searched == (3 * 2 * max(alone), 2 * sum(alone))


def test_translate_all_restores_input_order(tiny, reference):
  model, params = tiny
  # One batch [3, 32] (tokens_per_batch 96).
  outputs = kept.translate_all(
    model, params, SOURCES, tokens_per_batch=96, beam_size=1, max_extra_len=EXTRA
  )
  assert [o.tolist() for o in outputs] == [r[:-1] for r in reference]


@pytest.mark.parametrize(
  "how",
  [
    dict(beam_size=1),
    dict(beam_size=4),
    dict(temperature=1.5, rng=jax.random.key(1)),
    dict(temperature=1.5, top_k=20, rng=jax.random.key(1)),
  ],
)
def test_num_ids_keeps_outputs_inside_the_vocabulary(tiny, reference, how):
  model, params = tiny
  assert max(max(r) for r in reference) >= 10  # unrestricted, ids above 10 are chosen
  ids = np.asarray(
    kept.translate(model, params, padded(SOURCES), max_extra_len=EXTRA, num_ids=10, **how)
  )
  assert ids.max() < 10 and (ids == EOS).any(axis=1).all()


def test_num_ids_must_exceed_eos(tiny):
  model, params = tiny
  with pytest.raises(ValueError, match="num_ids=1: must exceed the EOS id"):
    kept.translate(model, params, padded(SOURCES), num_ids=1)


def test_sampling_batches_of_one_shape_draw_different_noise(tiny):
  model, params = tiny
  # One 8-token sentence per batch (tokens_per_batch 8): six batches of the same shape.
  outputs = kept.translate_all(
    model,
    params,
    [SOURCES[0]] * 6,
    tokens_per_batch=8,
    temperature=2.0,
    max_extra_len=EXTRA,
    rng=jax.random.key(3),
  )
  assert len({tuple(o.tolist()) for o in outputs}) > 1, [o.tolist() for o in outputs]
  # Batches decoded at once draw the same noise, each from its batch's number; scores too.
  how = dict(tokens_per_batch=8, temperature=2.0, max_extra_len=EXTRA, rng=jax.random.key(3))
  one = kept.translate_all(model, params, [SOURCES[0]] * 6, scores=True, **how)
  two = kept.translate_all(model, params, [SOURCES[0]] * 6, scores=True, parallel_batches=2, **how)
  hypotheses = lambda found: [[h.tolist() for h in o.ids] for o in found]
  assert hypotheses(two) == hypotheses(one)
  assert [o.ids[0].tolist() for o in one] == [o.tolist() for o in outputs]
  assert [o.scores.tolist() for o in two] == [o.scores.tolist() for o in one]
  with pytest.raises(ValueError, match="parallel_batches=0: must be a positive integer"):
    kept.translate_all(model, params, [SOURCES[0]], parallel_batches=0)


def test_attention_weights():
  model, params = random_model(num_layers=2, seed=0, eos_bias=0.0)
  src, out = SOURCES[1], [5, 6, 7]
  weights = attention_weights.attention_weights(model, params, src + [PAD, PAD], out + [EOS, PAD])
  assert weights.shape == (2, 4, len(out) + 1, len(src))
  np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
  assert (weights >= 0).all()
  # EOS is appended when the output has none.
  np.testing.assert_allclose(
    attention_weights.attention_weights(model, params, src, out), weights, atol=1e-6
  )


def test_same_shapes_do_not_recompile(tiny):
  model, params = tiny
  inputs = padded(SOURCES)
  first = kept.translate(model, params, inputs, beam_size=1, max_extra_len=EXTRA)
  with Compilations("jit(_search)") as compiled:
    # Other token values, other parameter values, an alpha that greedy ignores: same program.
    kept.translate(model, params, inputs[::-1].copy(), beam_size=1, max_extra_len=EXTRA)
    other = jax.tree_util.tree_map(lambda x: x * 1.5, params)
    second = kept.translate(model, other, inputs, beam_size=1, alpha=0.2, max_extra_len=EXTRA)
  assert compiled.count == 0
  # num_ids at the model's own vocabulary size masks nothing: the programs of no num_ids.
  assert Generator(model, num_ids=24).num_ids is None and Generator(model, num_ids=23).num_ids == 23
  assert not np.array_equal(first, second), "parameters must be an argument, not constants"


@pytest.mark.slow
def test_cache_follows_reordered_hypotheses(tiny):
  """Beam search reorders the per-hypothesis cache entries and keeps the cross-attention ones
  once per sentence. After random reorders, every hypothesis's cached logits must equal the
  teacher-forced logits of its own prefix."""
  from model import search

  model, params = tiny
  beams, steps = 3, 5
  inputs = padded(SOURCES[:2])
  batch = inputs.shape[0]
  # The random reorders and tokens, and the prefixes they make, drawn first: the cached steps
  # and the teacher-forced runs are then one program.
  rng = np.random.default_rng(0)
  prefixes = np.zeros((batch * beams, 0), np.int32)
  ids = [np.zeros((batch * beams, 1), np.int32)]
  targets, parents = [], []
  for t in range(steps):
    targets.append(np.concatenate([prefixes, np.full((batch * beams, steps - t), EOS)], axis=1))
    # Each new hypothesis continues a random parent of the same sentence.
    parents.append(rng.integers(0, beams, (batch, beams)))
    rows = (parents[-1] + np.arange(batch)[:, None] * beams).reshape(-1)
    ids.append(rng.integers(3, 24, (batch * beams, 1)).astype(np.int32))
    prefixes = np.concatenate([prefixes[rows], ids[-1]], axis=1)
  seen = {}

  @jax.jit
  def cached_and_forced(params, inputs, ids, targets, parents):
    # Buffers of 2 positions grown by 2 (then 1) as the steps go: reordering must carry the
    # grown buffers along too.
    step, cache, grow, segment = decoder_state.decoder_state(
      model, params, inputs, steps, segment=2
    )
    seen.update(grows=grow is not None, segment=segment)
    cache = search.expand_to_beams(cache, beams)
    cached = []
    for t in range(steps):
      if t and t % segment == 0:
        cache = grow(cache, min(segment, steps - t))
      logits, cache = step(ids[t], cache)
      cached.append(logits)
      cache = search.gather_beams(cache, parents[t], batch, beams)
    # Every step's prefixes teacher-forced in one run (rows are independent): position t of
    # step t's rows sees the shifted prefix.
    n = batch * beams
    sources = jnp.tile(jnp.repeat(inputs, beams, axis=0), (steps, 1))
    full = model.apply({"params": params}, sources, jnp.concatenate(targets))
    return cached, [full[t * n : (t + 1) * n, t] for t in range(steps)]

  cached, forced = cached_and_forced(params, inputs, ids[:steps], targets, parents)
  assert seen == {"grows": True, "segment": 2}
  for logits, full in zip(cached, forced):
    np.testing.assert_allclose(
      np.asarray(logits)[:, 2:], np.asarray(full)[:, 2:], rtol=1e-4, atol=1e-4
    )


def stack(*trees):
  return jax.tree_util.tree_map(lambda *xs: np.stack(xs), *trees)


@pytest.mark.slow
def test_ensemble_of_copies_decodes_as_the_model(tiny, reference):
  """An ensemble of two copies of one model is that model: the same greedy and beam outputs."""
  model, params = tiny
  inputs = padded(SOURCES)
  both = stack(params, params)
  ids = kept.translate(model, both, inputs, beam_size=1, max_extra_len=EXTRA, ensemble=True)
  assert rows(ids) == reference
  beam = kept.translate(model, params, inputs, beam_size=2, max_extra_len=EXTRA)
  np.testing.assert_array_equal(
    kept.translate(model, both, inputs, beam_size=2, max_extra_len=EXTRA, ensemble=True, segment=3),
    beam,
  )
  with pytest.raises(ValueError, match="use_cache"):
    kept.translate(model, both, inputs, ensemble=True, use_cache=False)


@pytest.mark.slow
def test_ensemble_step_is_the_log_of_the_mean_probability(tiny):
  """Each step of two different models' ensemble scores log((p_a + p_b) / 2), with each member
  reading its own cache: checked for three steps of forced tokens."""
  model, params_a = tiny
  _, params_b = random_model(num_layers=1, seed=5, eos_bias=0.0)
  inputs = padded(SOURCES[:3])
  tokens = (0, 7, 12)

  @jax.jit
  def steps(params_a, params_b, both, inputs):
    """Per forced token: each member's logits alone [2, 3, vocab], and the ensemble's."""
    singles = [decoder_state.decoder_state(model, p, inputs, 8) for p in (params_a, params_b)]
    ens = decoder_state.ensemble_decoder_state(model, both, inputs, 8)

    def step(carried, token):
      caches, cache = carried
      ids = jnp.full((3, 1), token, jnp.int32)
      outs = [s.step(ids, c) for s, c in zip(singles, caches)]
      mixed, cache = ens.step(ids, cache)
      return ([c for _, c in outs], cache), (jnp.stack([x for x, _ in outs]), mixed)

    carried = ([s.cache for s in singles], ens.cache)
    return jax.lax.scan(step, carried, jnp.asarray(tokens, jnp.int32))[1]

  alone, mixed = map(np.asarray, steps(params_a, params_b, stack(params_a, params_b), inputs))
  for logits, got in zip(alone, mixed):
    logp = [_log_softmax(x) for x in logits]
    want = np.logaddexp(logp[0], logp[1]) - np.log(2)  # log((p_a + p_b) / 2)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.exp(logp[0]), np.exp(logp[1]), atol=1e-3)
  with pytest.raises(ValueError, match="leading"):
    bad = stack(params_a, params_b)
    bad["decoder"]["logits"]["bias"] = bad["decoder"]["logits"]["bias"][:1]
    decoder_state.ensemble_decoder_state(model, bad, inputs, 8)


def _log_softmax(logits):
  """log softmax over the last axis, in float64 numpy."""
  x = np.asarray(logits, np.float64)
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.slow
def test_bfloat16_decoding_casts_the_matrices_once_and_stays_close(tiny):
  """model.dtype=bfloat16 (decode.py --dtype=bfloat16): every matrix the model multiplies by is
  cast once before the search (nothing else), the key/value cache holds bfloat16 values as
  float32 (the attention's products run in float32: no conversion of it at every step), the
  decoder's logits come out in float32, and the translations stay those of float32 for most
  sentences."""
  model, params = tiny
  fast = build_model(dict(model.config.__dict__, type="transformer", dtype="bfloat16"))
  assert decoder_state.matrices_for_decoding(model, params) is params
  cast = traverse_util.flatten_dict(decoder_state.matrices_for_decoding(fast, params))
  assert {p[-1] for p, x in cast.items() if x.dtype == jnp.bfloat16} == {"kernel", "embedding"}
  assert {p[-1] for p, x in cast.items() if x.dtype == jnp.float32} == {"bias", "scale"}

  def first_step(params, inputs):
    cache = decoder_state.initial_cache(fast, params, inputs, 8)
    logits, _ = fast.apply(
      {"params": params, **cache},
      jnp.zeros((len(SOURCES), 1), jnp.int32),
      method="decode_step",
      mutable=cache_kinds.CARRIED,
    )
    return logits, cache

  # Their dtypes, as traced (the same as computed, with nothing to compile).
  logits, cache = jax.eval_shape(first_step, params, padded(SOURCES))
  self_attention = cache[cache_kinds.TARGET]["decoder"]["layer_0"]["self_attention"]
  assert logits.dtype == jnp.float32 and self_attention["cached_key"].dtype == jnp.float32
  rows = 0
  for beam in (1, 2):  # float32's programs are the other tests'
    exact, close = (
      np.asarray(kept.translate(m, params, padded(SOURCES), beam_size=beam, max_extra_len=EXTRA))
      for m in (model, fast)
    )
    rows += np.sum(np.all(exact == close, axis=1))
  assert rows >= 0.75 * 2 * len(SOURCES), rows


# ----------------------------------------------------------------------------- settings
def test_search_settings_check_themselves_and_share_programs():
  """One frozen value: each bad field named in a one-line ValueError; settings that search the
  same way (any alpha when greedy, beam fields when sampling) map to one program; hashable, so
  jit caches on it."""
  for fields, message in (
    (dict(beam_size=0), "beam_size=0: must be >= 1"),
    (dict(beam_size=2.0), "beam_size=2.0: must be an integer"),
    (dict(alpha=-1.0), "alpha=-1.0: must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature=nan: must be a finite number >= 0"),
    (dict(length_penalty="wu"), "length_penalty='wu': must be one of"),
    (dict(max_extra_len=-1), "max_extra_len=-1: must be >= 0"),
    (dict(top_k=5), "top_k=5 applies to sampling only"),
    (dict(stopping="soon"), "stopping='soon': must be one of ('exact', 'finished') (or None)"),
    (dict(length_penalty="marian", temperature=1.0), "length_penalty='marian' is a beam search"),
    (dict(length_penalty="marian", stopping="exact"), "stopping='exact': length_penalty='marian'"),
    (
      dict(length_penalty="marian", prefix_rule="ctranslate2"),
      "prefix_rule='ctranslate2': length_penalty='marian' forces",
    ),
  ):
    with pytest.raises(ValueError, match=re.escape(message)):
      SearchSettings(**fields)
  greedy = SearchSettings(beam_size=1, alpha=0.2, length_penalty="fairseq")
  assert greedy.program() == SearchSettings(beam_size=1).program()
  sampled = SearchSettings(beam_size=5, alpha=1.0, temperature=1.0, top_k=3)
  assert sampled.program() == SearchSettings(beam_size=1, temperature=1.0, top_k=3).program()
  beam = SearchSettings(beam_size=5, alpha=1, length_penalty="fairseq")
  assert beam.program() == beam and beam.alpha == 1.0 and isinstance(beam.alpha, float)
  assert beam.describe() == "beam search (beam 5, alpha 1, fairseq length penalty)"
  assert len({beam, SearchSettings(beam_size=5, alpha=1.0, length_penalty="fairseq")}) == 1
  # The stopping rule: unset is the penalty's own, and maps to the program of that rule spelled
  # out; it matters to beam search only.
  gnmt = SearchSettings(beam_size=5)
  assert (gnmt.stopping_rule, beam.stopping_rule) == ("exact", "finished")
  assert gnmt.replace(stopping="exact").program() == gnmt.program() == gnmt
  assert beam.replace(stopping="finished").program() == beam
  for other in (gnmt.replace(stopping="finished"), beam.replace(stopping="exact")):
    assert other.program() == other and other.program() not in (gnmt, beam)
  assert greedy.replace(stopping="exact").program() == greedy.program()
  assert sampled.replace(stopping="finished").program() == sampled.program()
  assert beam.replace(stopping="exact").describe() == (
    "beam search (beam 5, alpha 1, fairseq length penalty, exact stopping)"
  )
  assert beam.replace(stopping="finished").describe() == beam.describe()
  # The prefix rule: its own program in every search, named in the log when not the default.
  for settings in (greedy, sampled, beam):
    ct2 = settings.replace(prefix_rule="ctranslate2")
    assert ct2.program() != settings.program() and ct2.program().prefix_rule == "ctranslate2"
    assert ct2.describe() == settings.describe() + ", ctranslate2 prefix rule"
  with pytest.raises(ValueError, match="prefix_rule='soft': must be one of"):
    beam.replace(prefix_rule="soft")
  with pytest.raises(dataclasses.FrozenInstanceError):
    beam.beam_size = 2
  with pytest.raises(ValueError, match="beam_size=0"):
    beam.replace(beam_size=0)


def test_a_generator_owns_its_programs(tiny):
  """A Generator compiles each settings' program once and keeps it while it lives; another
  Generator of the same model compiles its own (no module-wide cache behind it), and so does
  the one-off `translate`."""
  model, params = tiny
  inputs = padded(SOURCES)
  settings = SearchSettings(beam_size=1, max_extra_len=EXTRA + 2)  # compiled by no other test
  first = Generator(model)
  with Compilations("jit(_search)") as compiled:
    ids = first(params, inputs, settings)
    first(params, inputs, settings.replace(alpha=1.5))  # greedy ignores alpha: same program
  assert compiled.count == 1
  with Compilations("jit(_search)") as compiled:
    np.testing.assert_array_equal(Generator(model)(params, inputs, settings), ids)
  assert compiled.count == 1
  with Compilations("jit(_search)") as compiled:  # a one-off call compiles its own
    np.testing.assert_array_equal(generator.translate(model, params, inputs, settings), ids)
  assert compiled.count == 1
  with pytest.raises(ValueError, match="settings=.*expected a SearchSettings"):
    first(params, inputs, {"beam_size": 1})


@pytest.mark.slow
def test_one_program_serves_every_alpha_and_stopping_rule_as_constant_searches(tiny, tmp_path):
  """Beam search takes alpha and its stopping rule as arguments (`inference.generator._searched`):
  a sweep of both compiles one program for a batch, and a merged search's pieces once for all,
  kept on disk as one set; a setting's ids and scores are those of the search with it constant
  (the settings static under `jax.jit`) to the last bit: alpha 0.6 under 'gnmt' and the 'exact'
  rule (the penalty's division at a scalar length and at the array of the entries' limits, where
  XLA would turn a constant's division into a product), 1 under 'fairseq' and 'finished' (each
  rule's branch of the traced flag, each penalty's traced alpha); Marian's search, its alpha
  (`normalize`) an argument too, at 1."""
  model, params = tiny
  inputs = padded(SOURCES)
  alphas = (0.6, 1.0, 1.5)
  rules = [(alpha, stop) for alpha in alphas for stop in STOPPING]
  checked_rules = (("marian", 1.0, None), ("gnmt", 0.6, "exact"), ("fairseq", 1.0, "finished"))
  for penalty, checked, stop in checked_rules:  # fairseq last: the merged search below is its
    how = dict(beam_size=3, max_extra_len=EXTRA + 2, length_penalty=penalty)  # no other test's
    one = Generator(model)
    sweep = rules if stop else [(a, None) for a in alphas]  # Marian's own stopping rule
    with Compilations("jit(_search)") as compiled:
      found = {
        (a, s): one(params, inputs, SearchSettings(alpha=a, stopping=s, **how), scores=True)
        for a, s in sweep
      }
    assert compiled.count == 1
    found = {rule: [np.asarray(x) for x in arrays] for rule, arrays in found.items()}
    width = SRC_LEN + how["max_extra_len"]
    settings = SearchSettings(alpha=checked, stopping=stop, **how)
    constant = jax.jit(lambda p, x: generate.generate(model, p, x, None, settings, width, "scores"))
    for got, want in zip(found[checked, stop], constant(params, inputs)):
      np.testing.assert_array_equal(got, want)  # bitwise
  # A merged search (fairseq): 11 batches of 3 (8 or more later pieces: not searched whole),
  # paused and joined.
  lists = [list(s) for s in SOURCES] * 4
  store = ProgramStore(tmp_path)
  pieces = Generator(model, programs=store)
  for alpha, stop in rules:
    settings = SearchSettings(alpha=alpha, stopping=stop, **how)
    out = pieces.translate_all(params, lists, settings, tokens_per_batch=96)
    for i, sentence in enumerate(out[: len(SOURCES)]):
      assert sentence.tolist() == generate.strip(found[alpha, stop][0][i]).tolist(), (alpha, i)
  assert store.compiled == len(list(tmp_path.glob("*.program"))) > 1 and store.loaded == 0
  compiled = store.compiled  # n-best lists with scores: the same pieces (`_program_of`)
  settings = SearchSettings(alpha=alphas[-1], num_hypotheses=3, **how)
  best = pieces.translate_all(params, lists, settings, tokens_per_batch=96, scores=True)
  assert store.compiled == compiled
  for sentence, found in zip(best, out):
    assert len(sentence.ids) == 3 and sentence.ids[0].tolist() == found.tolist()
    assert np.all(np.diff(sentence.scores) <= 0)
  assert SearchSettings(beam_size=3, alpha=0.7).rule_argument
  for settings in (
    SearchSettings(beam_size=1),
    SearchSettings(beam_size=1, length_penalty="marian"),
    SearchSettings(temperature=1.0, beam_size=1),
  ):  # their programs keep alpha a constant (greedy and sampling ignore it; Marian's greedy
    # search scores with it)
    assert not settings.rule_argument
    with pytest.raises(ValueError, match="its rule is not an argument"):
      settings.with_rule(jnp.float32([1.0, 0.0]))


def test_a_files_nbest_and_scores_read_the_plain_searchs_programs(tiny):
  """`translate_all`'s beam search returns every beam hypothesis with its score, cut on the host
  (`inference.generator._program_of`): a file searched again for n-best lists or scores
  compiles nothing, and each sentence's hypotheses and scores are, to the last bit, those of
  the search compiled for them (`Generator.__call__`'s, on the same batch)."""
  model, params = tiny
  lists = [list(s) for s in SOURCES]
  how = dict(beam_size=3, alpha=0.8, max_extra_len=EXTRA + 1, length_penalty="fairseq")
  three = SearchSettings(num_hypotheses=3, **how)
  files = Generator(model, merge=False)
  with Compilations("jit(_search)") as compiled:
    plain = files.translate_all(params, lists, SearchSettings(**how))
    best = files.translate_all(params, lists, three, scores=True)
    two = files.translate_all(params, lists, SearchSettings(num_hypotheses=2, **how))
  assert compiled.count == 1
  (batch,) = length_buckets.length_batches(lists, 4096)
  ids, scores = map(np.asarray, Generator(model)(params, batch.inputs, three, scores=True))
  for row, i in enumerate(batch.indices):
    assert [h.tolist() for h in best[i].ids] == [generate.strip(h).tolist() for h in ids[row]]
    np.testing.assert_array_equal(best[i].scores, scores[row])  # bitwise
    assert plain[i].tolist() == best[i].ids[0].tolist()
    assert [h.tolist() for h in two[i]] == [h.tolist() for h in best[i].ids[:2]]


def test_programs_kept_on_disk_are_read_back_without_tracing(tiny, tmp_path, monkeypatch, caplog):
  """A Generator given an `inference.program_store.ProgramStore` writes each compiled search to
  its folder; a new store on that folder (a later process) reads it back, neither tracing nor
  compiling, and decodes the same. Another shape gets its own file, a file cut short is compiled
  again and replaced with a warning, an unwritable folder only warns, and a changed environment
  (XLA_FLAGS here) names another file."""
  model, params = tiny
  inputs = padded(SOURCES)
  settings = SearchSettings(beam_size=1, max_extra_len=EXTRA)
  expected = np.asarray(kept.translate(model, params, inputs, settings))  # as without a store
  store = ProgramStore(tmp_path)
  with Compilations("jit(_kept_search)") as compiled:
    ids = Generator(model, programs=store)(params, inputs, settings)
  np.testing.assert_array_equal(ids, expected)
  files = list(tmp_path.glob("*.program"))
  assert compiled.count == 1 and store.compiled == 1 and len(files) == 1

  again = ProgramStore(tmp_path)
  generator = Generator(model, programs=again)
  traced = Compilations("_kept_search", Compilations.TRACED)
  with traced, Compilations("jit(_kept_search)") as c:
    np.testing.assert_array_equal(generator(params, inputs, settings), expected)
    np.testing.assert_array_equal(generator(params, inputs, settings), expected)  # kept in memory
  assert (traced.count, c.count, again.loaded, again.compiled) == (0, 0, 1, 0)
  short = padded(SOURCES[:3], 32)  # the shape translate_all's test decodes
  np.testing.assert_array_equal(
    generator(params, short, settings), kept.translate(model, params, short, settings)
  )
  assert again.compiled == 1 and len(list(tmp_path.glob("*.program"))) == 2

  files[0].write_bytes(files[0].read_bytes()[:100])
  third = ProgramStore(tmp_path)
  with caplog.at_level("WARNING"):
    ids = Generator(model, programs=third)(params, inputs, settings)
  np.testing.assert_array_equal(ids, expected)
  assert third.compiled == 1 and "could not be read" in caplog.text and str(files[0]) in caplog.text
  fourth = ProgramStore(tmp_path)  # the replaced file reads back
  np.testing.assert_array_equal(
    Generator(model, programs=fourth)(params, inputs, settings), expected
  )
  assert (fourth.loaded, fourth.compiled) == (1, 0)

  (tmp_path / "a-file").write_text("")
  unwritable = ProgramStore(tmp_path / "a-file" / "programs")
  with caplog.at_level("WARNING"):
    ids = Generator(model, programs=unwritable)(params, inputs, settings)
  np.testing.assert_array_equal(ids, expected)
  assert "are not kept in" in caplog.text and unwritable.compiled == 1

  signature = "any program"
  before = store.path(signature)
  monkeypatch.setenv(
    "XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_math=false"
  )
  assert store.path(signature) != before


def test_a_files_programs_are_fetched_together_read_ahead_next_time(tiny, tmp_path):
  """translate_all with a store fetches one program per batch shape, concurrently (two buckets
  here), decodes as without a store, and leaves JAX's cache-write option as it found it. A later
  store reading ahead under the same key (inference/restore.py: workdir and checkpoint) reads
  both back in the background, the programs the first run asked for (`finish` recorded them),
  and decodes the same; under another key, with the record damaged or its files gone, nothing
  or only what is there is read ahead, and the rest read or compiled as before."""
  model, params = tiny
  long = [(3 + i) % 20 + 2 for i in range(39)] + [EOS]  # 40 tokens: the 64-token bucket
  sentences = [*SOURCES, long]
  settings = SearchSettings(beam_size=2, max_extra_len=EXTRA)
  expected = [x.tolist() for x in Generator(model).translate_all(params, sentences, settings)]
  option = jax.config.jax_persistent_cache_min_compile_time_secs

  def run(key=None):
    store = ProgramStore(tmp_path)
    if key is not None:
      store.read_ahead(key)
      if store._reader is not None:  # the reads ahead done first: counts that do not race
        store._reader.join()
    found = Generator(model, programs=store).translate_all(params, sentences, settings)
    store.finish()
    assert [x.tolist() for x in found] == expected
    return store.loaded, store.read_early, store.compiled

  assert run("a run") == (0, 0, 2)  # nothing recorded yet: nothing read ahead
  assert jax.config.jax_persistent_cache_min_compile_time_secs == option
  (record,) = tmp_path.glob("*.recent")
  programs = record.read_text().split()
  assert sorted(programs) == sorted(p.name for p in tmp_path.glob("*.program"))
  assert run() == (2, 0, 0)  # no key: read as asked, the record kept
  assert run("a run") == (2, 2, 0) and run("another run") == (2, 0, 0)
  record.write_bytes(b"\xff\x00")  # damaged: nothing read ahead, then written anew
  assert run("a run") == (2, 0, 0) and record.read_text().split() == programs
  (tmp_path / programs[0]).unlink()  # one file gone: the other read ahead, the first compiled
  # (asking for a program the record names but that was not read ahead stops nothing)
  assert run("a run") == (1, 1, 1)
  stopped = ProgramStore(tmp_path)
  stopped.read_ahead("a run")
  stopped.finish()  # nothing asked: the reading stopped, the record left as it was
  assert record.read_text().split() == programs


def test_reading_ahead_stops_at_a_program_the_last_run_did_not_ask_for(tmp_path, monkeypatch):
  """A run that asks for a program its key's last run did not (another input) stops the reading
  ahead: the program being read is finished and taken when asked for, the rest of the record is
  not read. One the record names whose file is gone stops nothing."""

  def lower(k):
    return lambda: jax.jit(lambda x: x + k).lower(1.0)

  first = ProgramStore(tmp_path)
  first.read_ahead("key")
  for k in (1, 2, 3):
    first(f"program {k}", lower(k))
  first.finish()
  (record,) = tmp_path.glob("*.recent")
  names = record.read_text().split()  # programs 1, 2, 3
  read = ProgramStore._read

  def held_store():
    """A store reading ahead under "key" whose reader waits inside its first read until
    `gate` is set: (store, gate, the files its reader read)."""
    entered, gate, by_reader = threading.Event(), threading.Event(), []

    def held(self, path, device):
      if threading.current_thread().name == "programs read ahead":
        by_reader.append(path.name)
        entered.set()
        gate.wait(30)
      return read(self, path, device)

    monkeypatch.setattr(ProgramStore, "_read", held)
    store = ProgramStore(tmp_path)
    store.read_ahead("key")
    assert entered.wait(30)
    return store, gate, by_reader

  (tmp_path / names[0]).unlink()  # program 1 gone: its reader begins at program 2
  store, gate, by_reader = held_store()
  assert float(store("program 1", lower(1))(1.0)) == 2.0  # named in the record: compiled
  gate.set()
  store._reader.join()  # nothing was stopped: program 3 read ahead too
  assert [float(store(f"program {k}", lower(k))(1.0)) for k in (2, 3)] == [3.0, 4.0]
  store.finish()
  assert by_reader == names[1:] and (store.read_early, store.loaded, store.compiled) == (2, 2, 1)

  second, gate, by_reader = held_store()  # the record again programs 1, 2, 3
  assert float(second("program 4", lower(4))(1.0)) == 5.0  # not in the record: compiled
  gate.set()
  assert float(second("program 1", lower(1))(1.0)) == 2.0  # the read in progress, taken
  second.finish()
  assert by_reader == names[:1] and (second.read_early, second.loaded, second.compiled) == (1, 1, 1)
