"""Scoring given translations: model/forced_scoring.py's teacher-forced log-probabilities against
the training loss and the searches' own scores, for every model type and an ensemble;
inference/pair_scoring.py's batching (order and batch shapes change nothing, few programs) and its
errors. Tiny random models and a word vocabulary: no trained workdir needed."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from data.tokenizer import WordVocab
from inference.generator import Generator
from inference.pair_scoring import PairScorer, pair_batches
from model import forced_scoring, search
from model.build import abstract_params, build_model
from model.decoder_state import (
  decoder_state,
  ensemble_decoder_state,
  only_ids_below,  # what decoding masks with (num_ids)
)
from model.search_settings import SearchSettings
from model.special_tokens import EOS_ID, PAD_ID
from tests.helpers import MODEL_TYPES, Compilations, fixed_batches, tiny_config
from training.step import eval_step

_MODELS: dict = {}  # one model and parameters per arguments, kept for the module


def _model(kind="transformer", seed=0, **overrides):
  """A tiny model of `kind` (tests/helpers.py tiny_config) and random numpy parameters of its
  shapes (no initialisation program to compile), the same object for the same arguments: its
  jitted programs are compiled once for the module."""
  key = (kind, seed, tuple(sorted(overrides.items())))
  if key not in _MODELS:
    config = tiny_config(**{"model.type": kind, **overrides})
    rng = np.random.default_rng(seed)
    flat = {}
    for path, leaf in traverse_util.flatten_dict(abstract_params(config.model)).items():
      if path[-1] == "scale":
        flat[path] = np.ones(leaf.shape, np.float32)
      elif "bias" in path[-1]:
        flat[path] = 0.1 * rng.standard_normal(leaf.shape, np.float32)
      else:  # matrices, embeddings, attention vectors: unit variance through a 32-wide layer
        limit = np.sqrt(3 / config.model.d_model)
        flat[path] = rng.uniform(-limit, limit, leaf.shape).astype(np.float32)
    _MODELS[key] = build_model(config.model), traverse_util.unflatten_dict(flat)
  return _MODELS[key]


def _stack(*trees):
  """Parameter trees stacked on a leading axis (an ensemble's members), in numpy."""
  return jax.tree_util.tree_map(lambda *xs: np.stack(xs), *trees)


_scored = jax.jit(
  forced_scoring.score, static_argnums=0, static_argnames=("ensemble", "as_search", "num_ids")
)


def _score(params, inputs, targets, *, model, ensemble=False, as_search=False, num_ids=None):
  """`forced_scoring.score` jitted once for the module: each (model, options, shapes) compiles once
  (every option passed, so that a default and the same value given share the program)."""
  return _scored(
    model, params, inputs, targets, ensemble=ensemble, as_search=as_search, num_ids=num_ids
  )


def _packed(batch, a, b):
  """Rows `a` and `b` of an unpacked pipeline batch packed into one row (segments 1 and 2)."""
  out = {}
  for side in ("inputs", "targets"):
    row = {k: [] for k in ("tok", "seg", "pos")}
    for segment, r in ((1, a), (2, b)):
      n = int(batch[f"{side}_segmentation"][r].sum())
      row["tok"] += list(batch[side][r, :n])
      row["seg"] += [segment] * n
      row["pos"] += list(range(n))
    width = 2 * batch[side].shape[1]
    pad = lambda xs: np.array([xs + [0] * (width - len(xs))], np.int32)
    out[side] = pad(row["tok"])
    out[f"{side}_segmentation"] = pad(row["seg"])
    out[f"{side}_position"] = pad(row["pos"])
  return out


@functools.partial(jax.jit, static_argnums=0)
def _score_and_nll(model, params, batch, packed):
  """The scores of `batch`'s pairs; the eval step's unsmoothed nll of the whole batch and of
  each of `packed`'s batches (stacked on a leading axis): one program per model."""
  token_logp, total = forced_scoring.score(model, params, batch["inputs"], batch["targets"])
  nll = lambda b: eval_step(params, b, model=model, label_smoothing=0.0)["nll"]
  return token_logp, total, nll(batch), jax.vmap(nll)(packed)


@pytest.mark.parametrize(
  "kind",
  [k if k == "transformer" else pytest.param(k, marks=pytest.mark.slow) for k in MODEL_TYPES],
)
def test_scores_are_minus_the_training_loss_on_the_same_pairs(kind):
  model, params = _model(kind)
  (batch,) = fixed_batches(n=1, rows=6, length=8, seed=1)
  # Pairs packed two in a row as training packs them (one pair's loss is its row's when the
  # other pair is row 0's, read twice): row 0 with each row r, each its own batch.
  packed = _stack(*(_packed(batch, 0, r) for r in range(6)))
  token_logp, total, whole, each = map(np.asarray, _score_and_nll(model, params, batch, packed))
  assert np.all(token_logp[batch["targets"] == PAD_ID] == 0)
  assert np.all(token_logp[batch["targets"] != PAD_ID] < 0)
  np.testing.assert_allclose(total, token_logp.sum(axis=1), rtol=1e-6)
  np.testing.assert_allclose(-total.sum(), whole, rtol=1e-6)  # the whole batch
  for r in range(1, 6):
    loss = each[r] - each[0] / 2
    np.testing.assert_allclose(-total[r], loss, rtol=1e-5)


# The one pair shape [ROWS, WIDTH] of the model-level checks below: a search's hypotheses and the
# batches they are scored with share programs (`_score`, per model and options).
ROWS, WIDTH = 12, 10


def _fitted(ids):
  """[n <= ROWS, w <= WIDTH] ids as [ROWS, WIDTH]: PAD on the right, spare rows repeating the
  last one (scores are per row: the first n rows are those of `ids`)."""
  ids = np.asarray(ids, np.int32)
  out = np.zeros((ROWS, WIDTH), np.int32)
  out[: len(ids), : ids.shape[1]] = ids
  out[len(ids) :] = out[len(ids) - 1]
  return out


def _forced(model, params, sources, targets, *, ensemble, num_ids):
  """`_score` with as_search of [n, w] pairs through the one shape `_fitted` gives them (the
  other checks' programs): (token log-probabilities [n, WIDTH], totals [n]) in numpy."""
  token_logp, total = _score(
    params,
    _fitted(sources),
    _fitted(targets),
    model=model,
    ensemble=ensemble,
    as_search=True,
    num_ids=num_ids,
  )
  return np.asarray(token_logp)[: len(sources)], np.asarray(total)[: len(sources)]


def _searched(model, params, inputs, beam, ensemble, max_len=7, num_ids=30):
  """(beam search's hypotheses [batch * beam, max_len] and scores at alpha 0, with PAD and ids
  >= num_ids impossible; with beam 1, greedy search's output too), in one program."""

  def run(params, inputs):
    make = ensemble_decoder_state if ensemble else decoder_state
    state = make(model, params, inputs, max_len)
    step = only_ids_below(state.step, num_ids)
    ids, scores = search.beam_search(
      step,
      state.cache,
      inputs.shape[0],
      max_len,
      beam_size=beam,
      alpha=0.0,
      grow=state.grow,
      segment=state.segment,
    )
    rows = ids.reshape(-1, max_len)  # each ends with EOS or runs to max_len without one
    if beam > 1:
      return rows, scores.reshape(-1)
    greedy = search.greedy_search(  # beam 1 is greedy search
      step, state.cache, inputs.shape[0], max_len, grow=state.grow, segment=state.segment
    )
    return rows, scores.reshape(-1), greedy

  return jax.jit(run)(params, jnp.asarray(inputs))


@pytest.mark.slow
@pytest.mark.parametrize(
  "kind, ensemble, beam",
  [(kind, False, 3) for kind in MODEL_TYPES]
  + [("transformer", False, 1), ("transformer", True, 3)],
)
def test_a_searched_hypothesis_scores_what_the_search_scored_it(kind, ensemble, beam):
  """Beam search at alpha 0, every hypothesis of its n-best list (beam 1: greedy search's
  output), PAD and ids >= num_ids impossible: the forced score with as_search equals the
  search's own."""
  model, params = _model(kind)
  if ensemble:
    params = _stack(params, _model(kind, seed=1)[1])
  (batch,) = fixed_batches(n=1, rows=3, length=6, seed=2)
  rows, scores, *greedy = map(np.asarray, _searched(model, params, batch["inputs"], beam, ensemble))
  sources = np.repeat(batch["inputs"], beam, axis=0)
  _, total = _forced(model, params, sources, rows, ensemble=ensemble, num_ids=30)
  found = np.isfinite(scores)
  assert found.sum() >= len(batch["inputs"])
  np.testing.assert_allclose(total[found], scores[found], rtol=2e-5, atol=2e-5)
  if beam == 1:
    np.testing.assert_array_equal(greedy[0], rows)


def test_an_ensemble_of_copies_scores_as_the_model():
  """Two copies of one model, as an ensemble, score each token as the model does, with the
  training loss's distribution and with the searches' (num_ids 30, the targets' ids below it).
  The programs are those of the other checks at [ROWS, WIDTH] (the searches' of two members:
  `_forced`'s of an ensemble)."""
  model, params = _model()
  stacked = _stack(params, params)
  (batch,) = fixed_batches(n=1, rows=ROWS, length=WIDTH, seed=3)
  x, y = batch["inputs"], batch["targets"]
  for as_search, targets, num_ids in ((False, y, None), (True, np.where(y >= 30, y - 26, y), 30)):
    how = dict(model=model, as_search=as_search, num_ids=num_ids)
    one = _score(params, x, targets, **how)
    two = _score(stacked, x, targets, ensemble=True, **how)
    assert np.all(np.isfinite(one[0]))
    np.testing.assert_allclose(two[0], one[0], rtol=1e-5, atol=1e-6)


_logits = jax.jit(
  lambda params, x, y, *, model: model.apply({"params": params}, x, y), static_argnames="model"
)


def test_the_searches_distribution_leaves_out_pad():
  """as_search renormalises over fewer ids: every token is more likely, by the same factor per
  position as the PAD (and extra ids') probability it takes away."""
  model, params = _model()
  (batch,) = fixed_batches(n=1, rows=ROWS, length=WIDTH, seed=4)
  x, y = batch["inputs"], np.where(batch["targets"] >= 30, batch["targets"] - 26, batch["targets"])
  full, _ = _score(params, x, y, model=model)
  searched, _ = _score(params, x, y, model=model, as_search=True, num_ids=30)
  logits = np.asarray(_logits(params, x, y, model=model), np.float64)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  kept = 1.0 - probs[..., PAD_ID] - probs[..., 30:].sum(-1)
  real = y != PAD_ID
  np.testing.assert_allclose(
    np.asarray(searched)[real], (np.asarray(full) - np.log(kept))[real], rtol=1e-5, atol=1e-5
  )


def test_model_scoring_rejects_bad_shapes():
  model, params = _model()
  with pytest.raises(ValueError, match="inputs and targets must be"):
    forced_scoring.score(model, params, np.ones((2, 4), np.int32), np.ones((3, 4), np.int32))
  with pytest.raises(ValueError, match="num_ids applies"):
    forced_scoring.score(
      model, params, np.ones((2, 4), np.int32), np.ones((2, 4), np.int32), num_ids=9
    )


# ----------------------------------------------------------------------------- pairs of text
WORDS = [f"w{i}" for i in range(30)]  # 34 ids: the model's 36 output rows include 2 spare ones


def _scorer(max_len=80, **kwargs):
  model, params = _model(**{"model.max_len": max_len})
  return PairScorer(model, params, WordVocab(WORDS), max_len=max_len, **kwargs)


_SCORERS: list = []


def _shared_scorer():
  """`_scorer(max_len=32)`, one for the tests that only read scores of short pairs: its programs
  compile once, and its model is `_model()`, the model-level checks' (their `_score` programs
  serve its references)."""
  if not _SCORERS:
    _SCORERS.append(_scorer(max_len=32))
  return _SCORERS[0]


def _pairs(n, seed=0, longest=60):
  rng = np.random.default_rng(seed)
  line = lambda k: " ".join(rng.choice(WORDS, k))
  sources = [line(int(rng.integers(0, longest))) for _ in range(n)]
  targets = [line(int(rng.integers(1, longest))) for _ in range(n)]
  return sources, targets


def test_pair_scores_are_the_models_on_the_tokenized_pairs():
  scorer = _shared_scorer()
  vocab = scorer.vocab
  sources, targets = ["w1 w2 w3", "w4 nonword", ""], ["w5 w6", "w7", "w8 w9 w10 w11"]
  scored = scorer.score(sources, targets)
  x = np.zeros((3, 8), np.int32)
  y = np.zeros((3, 8), np.int32)
  for i, (s, t) in enumerate(zip(sources, targets)):
    x[i, : len(vocab.encode(s)) + 1] = vocab.encode(s) + [EOS_ID]
    y[i, : len(vocab.encode(t)) + 1] = vocab.encode(t) + [EOS_ID]
  # At [ROWS, WIDTH] (`_fitted`: the first 3 rows are x's and y's), the other checks' program.
  token_logp, total = map(
    np.asarray, _score(scorer.params, _fitted(x), _fitted(y), model=scorer.model)
  )
  for i, pair in enumerate(scored):
    n = len(vocab.encode(targets[i])) + 1
    assert pair.ids == vocab.encode(targets[i]) + [EOS_ID]
    assert pair.tokens == targets[i].split() + ["</s>"]
    assert pair.token_log_probs.shape == (n,)
    np.testing.assert_allclose(pair.token_log_probs, token_logp[i, :n], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(pair.log_prob, total[i], rtol=1e-5)
    np.testing.assert_allclose(pair.log_prob, pair.token_log_probs.sum(), rtol=1e-6)
    assert pair.mean_log_prob == pytest.approx(pair.log_prob / n)
  searched = scorer.score(sources, targets, as_search=True)
  assert all(a.log_prob > b.log_prob for a, b in zip(searched, scored))


@pytest.mark.slow
def test_order_and_batch_shapes_change_no_score_and_shapes_compile_once():
  sources, targets = _pairs(40)
  scorer = _scorer()
  batches = pair_batches(scorer.encode(sources, "sources"), scorer.encode(targets, "targets"), 1024)
  assert sorted(i for b in batches for i in b[0]) == list(range(40))
  assert len({(x.shape, y.shape) for _, x, y in batches}) == 4  # 2 source x 2 target buckets
  with Compilations("jit(score_batch)") as compiled:
    first = scorer.score(sources, targets, tokens_per_batch=1024)
  assert compiled.count == 4
  with Compilations("jit(score_batch)") as compiled:
    again = scorer.score(sources[::-1], targets[::-1], tokens_per_batch=1024)
  assert compiled.count == 0
  small = scorer.score(sources, targets, tokens_per_batch=96)  # one or two rows a batch
  for a, b, c in zip(first, again[::-1], small):
    assert a.ids == b.ids == c.ids
    np.testing.assert_allclose(b.token_log_probs, a.token_log_probs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(c.token_log_probs, a.token_log_probs, rtol=1e-5, atol=1e-5)


def test_scores_on_devices_split_the_rows_as_the_translator_does():
  devices = jax.devices()[:2]
  rows = NamedSharding(Mesh(np.asarray(devices), ("batch",)), PartitionSpec("batch"))
  sources, targets = _pairs(3, seed=1, longest=20)  # 3 rows: 4 with the batch's spare one
  one = _shared_scorer().score(sources, targets)
  two = _scorer(batch_multiple=2, place=lambda ids: jax.device_put(ids, rows)).score(
    sources, targets
  )
  for a, b in zip(one, two):
    np.testing.assert_allclose(b.token_log_probs, a.token_log_probs, rtol=1e-5, atol=1e-5)


def test_an_ensemble_of_pairs():
  scorer = _shared_scorer()
  stacked = _stack(scorer.params, scorer.params)
  sources, targets = _pairs(3, seed=2, longest=10)
  one = scorer.score(sources, targets)
  two = PairScorer(scorer.model, stacked, scorer.vocab, max_len=32, ensemble=True).score(
    sources, targets
  )
  for a, b in zip(one, two):
    np.testing.assert_allclose(b.token_log_probs, a.token_log_probs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
  "sources, targets, options, message",
  [
    (["w1", "w2"], ["w1"], {}, r"^targets: 1 sentences for 2 sources"),
    (["w1", "w2"], ["w1", "  "], {}, r"^targets\[1\] is empty"),
    (["w1 " * 40], ["w1"], {}, r"^sources\[0\] has 41 tokens with EOS, more than .*max_len=32"),
    (["w1"], ["w1 " * 32], {}, r"^targets\[0\] has 33 tokens"),
    ("w1 w2", ["w1"], {}, r"^sources: expected a list of sentences, got one string"),
    (["w1"], ["w1"], {"tokens_per_batch": 0}, r"^tokens_per_batch=0: must be positive"),
  ],
)
def test_bad_input_is_one_line_naming_the_argument(sources, targets, options, message):
  scorer = _scorer(max_len=32)
  with pytest.raises(ValueError, match=message) as raised:
    scorer.score(sources, targets, **options)
  assert "\n" not in str(raised.value)


def _rescored(model, params, inputs, found, settings, num_ids, ensemble):
  """Each hypothesis' score recomputed independently, in a second pass: each hypothesis (EOS
  appended) scored teacher-forced under the searches' distribution, its
  EOS made free when it sits at the sentence's length limit (beam search with the fairseq
  penalty: no EOS there, the hypothesis ends with its last token), the log-probability summed
  and, in beam search, divided by the length penalty's formula."""
  pairs = [(i, ids) for i, nbest in enumerate(found) for ids in nbest.ids]
  targets = np.zeros((len(pairs), max(len(ids) for _, ids in pairs) + 1), np.int32)
  for row, (_, ids) in enumerate(pairs):
    targets[row, : len(ids) + 1] = [*ids.tolist(), EOS_ID]
  sources = np.asarray(inputs)[[i for i, _ in pairs]]
  token_logp, _ = _forced(model, params, sources, targets, ensemble=ensemble, num_ids=num_ids)
  token_logp = token_logp.astype(np.float64)
  scores, tokens = [[] for _ in found], [[] for _ in found]
  for row, (i, ids) in enumerate(pairs):
    length = len(ids) + 1
    logp = token_logp[row, :length].copy()
    if length >= np.sum(sources[row] != PAD_ID) + settings.max_extra_len:
      logp[-1] = 0.0  # forced at the limit: free
      if settings.beam_size > 1 and settings.length_penalty == "fairseq":
        length, logp = length - 1, logp[:-1]  # ended at its last step, CTranslate2's rule
    alpha = settings.alpha
    if settings.sampling or settings.beam_size == 1:
      divisor = 1.0
    elif settings.length_penalty == "fairseq":
      divisor = length**alpha
    else:
      divisor = ((5.0 + length) / 6.0) ** alpha
    scores[i].append(logp.sum() / divisor)
    tokens[i].append(logp)
  return scores, tokens


@pytest.mark.parametrize(
  "kind, ensemble, settings",
  [
    ("transformer", False, SearchSettings(beam_size=3, alpha=0.6, num_hypotheses=3)),
    ("transformer", False, SearchSettings(beam_size=3, alpha=1.0, length_penalty="fairseq")),
    ("transformer", True, SearchSettings(beam_size=2, alpha=0.6, num_hypotheses=2)),
    ("transformer", False, SearchSettings(beam_size=1)),
    ("transformer", False, SearchSettings(temperature=1.0, top_k=5)),
  ]
  + [
    pytest.param(
      kind, False, SearchSettings(beam_size=3, length_penalty=penalty), marks=pytest.mark.slow
    )
    for kind in MODEL_TYPES[1:]
    for penalty in ("gnmt", "fairseq")
  ],
)
def test_the_search_returns_the_scores_a_second_pass_gave(kind, ensemble, settings):
  """`Generator.translate_all(scores=True, token_scores=True)`: the search's own scores and
  token log-probabilities, in the same pass as its hypotheses, equal those of scoring the
  hypotheses again (teacher-forced, the searches' distribution, the forced-EOS rule and the
  length penalty written out), for every model type, both penalties, an ensemble, greedy
  search and sampling; the hypotheses are those of a search without scores."""
  model, params = _model(kind)
  if ensemble:
    params = _stack(params, _model(kind, seed=1)[1])
  (batch,) = fixed_batches(n=1, rows=4, length=6, seed=3)
  sentences = [row[row != PAD_ID].tolist() for row in batch["inputs"]]
  settings = settings.replace(max_extra_len=3)
  # Buffers for the whole output (segment=None): outputs of at most 9 tokens never reach the
  # default's second segment (at 16; growing is tests/test_generate.py's), so a loop less to
  # compile.
  generator = Generator(model, num_ids=30, ensemble=ensemble, segment=None)
  found = generator.translate_all(params, sentences, settings, scores=True, token_scores=True)
  plain = generator.translate_all(params, sentences, settings)
  for nbest, ids in zip(found, plain):
    expected = ids if settings.num_hypotheses > 1 else [ids]
    assert [h.tolist() for h in nbest.ids] == [h.tolist() for h in expected]
  inputs = np.zeros((len(sentences), 6), np.int32)
  for row, s in enumerate(sentences):
    inputs[row, : len(s)] = s
  scores, tokens = _rescored(model, params, inputs, found, settings, 30, ensemble)
  for nbest, want, want_tokens in zip(found, scores, tokens):
    assert nbest.scores.shape == (settings.num_hypotheses,)
    np.testing.assert_allclose(nbest.scores, want, rtol=2e-5, atol=2e-5)
    for got, expected in zip(nbest.token_scores, want_tokens):
      np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5)
