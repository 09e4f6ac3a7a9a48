"""The recurrent and decoder-only models (model/rnn.py, model/decoder_only.py) through the shared
interface of model/build.py: shapes and gradients, cached decoding against teacher forcing,
padding, packing, causality, search, and the model.type registry.

Each tiny model runs everything once in a single jitted function (`_run`, cached by `results`), so
every test of that model shares one compilation (keeps the file fast on 2 cores); its parameters
are drawn by numpy in the tree `model.init` makes (traced only: an initialization's random draws
are slow to compile).
"""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax import lax

from model import cache_kinds, decoder_state, masks, search
from model.build import MODEL_TYPES, DeferredModel, abstract_params, build_model
from model.config import TransformerConfig
from model.decoder_only import DecoderOnly, combined_sequence
from model.rnn import RNNConfig, RNNSeq2Seq
from model.special_tokens import SEP_ID
from model.transformer import Decoder, shift_right
from tests.helpers import numpy_params

VOCAB = 40
SRC = [[5, 6, 7, 1], [8, 9, 10, 11, 12, 1], [13, 1]]
TGT = [[4, 5, 1], [6, 7, 8, 9, 1], [10, 11, 12, 14, 15, 1]]
SRC_LEN, TGT_LEN = 7, 6
MAX_DECODE = TGT_LEN
MAX_LENS = np.array([3, 6, 5], np.int32)  # per-sentence output limits, EOS included


def _pad(rows, length):
  out = np.zeros((len(rows), length), np.int32)
  for i, r in enumerate(rows):
    out[i, : len(r)] = r
  return out


def _pack(groups, length):
  """Rows of packed sentences -> (tokens, positions, segment ids), each [rows, length]."""
  tok, pos, seg = (np.zeros((len(groups), length), np.int32) for _ in range(3))
  for i, group in enumerate(groups):
    col = 0
    for s, sentence in enumerate(group):
      n = len(sentence)
      tok[i, col : col + n], pos[i, col : col + n], seg[i, col : col + n] = (
        sentence,
        range(n),
        s + 1,
      )
      col += n
  return tok, pos, seg


INPUTS, TARGETS = _pad(SRC, SRC_LEN), _pad(TGT, TGT_LEN)
PADDED_INPUTS = _pad(SRC, SRC_LEN + 4)  # the same sentences with extra source padding
# Row 0 packs sentences 0 and 1, row 1 holds sentence 2 alone (and padding).
PACK = [[0, 1], [2]]
P_IN, P_IN_POS, P_IN_SEG = _pack([[SRC[i] for i in g] for g in PACK], 12)
P_TGT, P_TGT_POS, P_TGT_SEG = _pack([[TGT[i] for i in g] for g in PACK], 10)
CHANGED_AT = 2  # causality: targets change from this position on
CHANGED = TARGETS.copy()
CHANGED[:, CHANGED_AT:] = np.where(TARGETS[:, CHANGED_AT:] > 0, 20, 0)


def _xent(logits, targets):
  logp = jax.nn.log_softmax(logits.astype(jnp.float32))
  nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  return jnp.sum(nll * (targets > 0))


def _no_pad(logits):
  return logits.astype(jnp.float32).at[:, 0].set(-jnp.inf)


# Compiling dominates this file's time; these tiny programs need no optimized code.
_FAST_COMPILE = dict(xla_backend_optimization_level=0, xla_cpu_use_fusion_emitters=False)


BASIC, SEARCH = "basic", "search"


@functools.partial(jax.jit, static_argnums=(0, 1), compiler_options=_FAST_COMPILE)
def _run(model, tier, params, rng):
  """Everything the tests check, for one model with parameters `params`, in one compilation:
  shapes, gradients and cached decoding (BASIC); SEARCH adds padding, packing, causality, greedy,
  beam, grown and ensemble search (and, decoder-only, the layout and the target-only
  projection)."""
  apply = lambda *a, **k: model.apply({"params": params}, *a, **k)

  def cache_for(inputs):
    encoded = apply(inputs, method="encode")
    return apply(encoded, inputs, MAX_DECODE, method="init_cache", mutable=cache_kinds.COLLECTIONS)[
      1
    ]

  def step(cache, ids):
    logits, state = model.apply(
      {"params": params, **cache}, ids[:, None], method="decode_step", mutable=cache_kinds.CARRIED
    )
    return {**cache, **state}, logits

  out = {}
  cache = cache_for(INPUTS)
  _, stepped = lax.scan(step, cache, shift_right(jnp.asarray(TARGETS)).T)
  out["stepped"] = jnp.swapaxes(stepped, 0, 1)
  out["cache_leaves"] = [jnp.shape(x) for x in jax.tree_util.tree_leaves(cache)]

  def loss(p):  # packed rows, dropout on
    logits = model.apply(
      {"params": p},
      P_IN,
      P_TGT,
      P_IN_POS,
      P_TGT_POS,
      P_IN_SEG,
      P_TGT_SEG,
      deterministic=False,
      rngs={"dropout": jax.random.fold_in(rng, 1)},
    )
    return _xent(logits, P_TGT)

  out["loss"], out["grads"] = jax.value_and_grad(loss)(params)
  if tier == BASIC:
    out["logits"] = apply(INPUTS, TARGETS)
    return out
  out.update(_searches(model, params, step, cache))
  # One teacher-forced batch: the targets, the changed targets and the greedy outputs.
  rows = apply(jnp.tile(INPUTS, (3, 1)), jnp.concatenate([TARGETS, CHANGED, out["greedy"]]))
  out["logits"], out["changed"], out["greedy_tf"] = jnp.split(rows, 3)
  out["padded"] = apply(PADDED_INPUTS, TARGETS)
  out["packed"] = apply(P_IN, P_TGT, P_IN_POS, P_TGT_POS, P_IN_SEG, P_TGT_SEG)
  if isinstance(model, DecoderOnly):
    out.update(_decoder_only_references(model, params, out["packed"]))
  return out


def _searches(model, params, step, cache):
  """Greedy and beam search through `step` over the cache; beam search through
  `decoder_state` with self-attention buffers grown 2 positions at a time, and through an
  ensemble of two copies of the model."""
  out = {}
  step_fn = lambda ids, cache: (lambda c, lg: (_no_pad(lg), c))(*step(cache, ids[:, 0]))
  batch = INPUTS.shape[0]
  out["greedy"] = search.greedy_search(step_fn, cache, batch, MAX_DECODE, max_lens=MAX_LENS)
  out["beams"], out["beam_scores"] = search.beam_search(
    step_fn, cache, batch, MAX_DECODE, beam_size=3, max_lens=MAX_LENS
  )
  # The same search with self-attention buffers grown 2 positions at a time (none for RNNs).
  grown = decoder_state.decoder_state(model, params, INPUTS, MAX_DECODE, segment=2)
  out["grows"] = grown.grow is not None
  out["beams_grown"], _ = search.beam_search(
    grown.step,
    grown.cache,
    batch,
    MAX_DECODE,
    beam_size=3,
    max_lens=MAX_LENS,
    grow=grown.grow,
    segment=grown.segment,
  )
  # An ensemble of two copies of the model (members on a leading axis) searches as the model.
  copies = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), params)
  ens = decoder_state.ensemble_decoder_state(model, copies, INPUTS, MAX_DECODE, segment=2)
  out["beams_ensemble"], _ = search.beam_search(
    ens.step,
    ens.cache,
    batch,
    MAX_DECODE,
    beam_size=3,
    max_lens=MAX_LENS,
    grow=ens.grow,
    segment=ens.segment,
  )
  return out


def _decoder_only_references(model, params, packed):
  """The decoder-only model's logits recomputed from its stack: for sentence 1 with the layout
  written out by hand (`by_hand`), and for the packed rows with every source and target position
  projected to the vocabulary, the target part sliced afterwards (`projected_all`), with the
  label-smoothed losses of both and of the model's own logits of those rows (`packed`)."""
  from model.loss import smoothed_cross_entropy

  out = {}
  seq = jnp.asarray([SRC[1] + [SEP_ID] + TGT[1][:-1]])
  length = seq.shape[1]
  stack = Decoder(model.config, cross_attention=False)
  positions = jnp.arange(length)[None]
  full = stack.apply(
    {"params": params["decoder"]}, seq, positions, None, masks.causal_mask(length), None, True
  )
  out["by_hand"] = full[0, len(SRC[1]) :]
  tokens, positions, mask = combined_sequence(P_IN, P_TGT, P_IN_POS, P_TGT_POS, P_IN_SEG, P_TGT_SEG)
  every = stack.apply({"params": params["decoder"]}, tokens, positions, None, mask, None, True)
  out["projected_all"] = every[:, P_IN.shape[1] :]
  loss = lambda lg: smoothed_cross_entropy(lg, P_TGT, P_TGT > 0, 0.1)[0]
  out["projected_loss"], out["projected_all_loss"] = loss(packed), loss(out["projected_all"])
  return out


def _rnn(cell, bidirectional, layers, attention=False, share=True):
  cfg = RNNConfig(
    vocab_size=VOCAB,
    d_model=32,
    num_layers=layers,
    dropout_rate=0.1,
    rnn_cell=cell,
    rnn_bidirectional=bidirectional,
    share_embeddings=share,
  )
  return RNNSeq2Seq(cfg, attention=attention)


def _decoder_only(pre_ln, share, layers):
  return DecoderOnly(
    TransformerConfig(
      vocab_size=VOCAB,
      d_model=32,
      d_ff=64,
      num_heads=4,
      num_layers=layers,
      dropout_rate=0.1,
      pre_ln=pre_ln,
      share_embeddings=share,
    )
  )


# name -> (model, tier): every model gets shapes, gradients and cached decoding; SEARCH ones also
# padding, packing, causality and search. Each model compiles once, so the set is kept small: the
# four recurrent models cover every pair of values of cell, direction and attention (the options
# that change the recurrent state and what the decoder reads), one of them with two layers and
# unshared embeddings; one search model per decoder (context vector, attention, decoder-only).
MODELS = {
  "rnn-gru-bi-1": (lambda: _rnn("gru", True, 1), SEARCH),
  "attention-gru-uni-1": (lambda: _rnn("gru", False, 1, attention=True), BASIC),
  "rnn-lstm-uni-2-unshared": (lambda: _rnn("lstm", False, 2, share=False), BASIC),
  "attention-lstm-bi-1": (lambda: _rnn("lstm", True, 1, attention=True), SEARCH),
  "decoder_only-pre-unshared-2": (lambda: _decoder_only(True, False, 2), SEARCH),
}
SEARCH_MODELS = [name for name, (_, tier) in MODELS.items() if tier == SEARCH]
DECODER_ONLY = [name for name in MODELS if name.startswith("decoder_only")]


@functools.cache
def results(name):
  make, tier = MODELS[name]
  model = make()
  return jax.tree_util.tree_map(
    np.asarray, _run(model, tier, numpy_params(model, INPUTS, TARGETS), jax.random.key(0))
  )


VALID = TARGETS > 0
all_models = pytest.mark.parametrize("name", list(MODELS))
search_models = pytest.mark.parametrize("name", SEARCH_MODELS)


@pytest.mark.slow
@all_models
def test_shapes_and_finite_gradients(name):
  r = results(name)
  assert r["logits"].shape == (3, TGT_LEN, VOCAB)
  assert np.isfinite(r["loss"]) and r["loss"] > 0
  for path, g in jax.tree_util.tree_flatten_with_path(r["grads"])[0]:
    assert np.all(np.isfinite(g)), path
    assert np.any(g != 0), f"no gradient reaches {jax.tree_util.keystr(path)}"
  # Every cache leaf is per sentence (leading batch) or a scalar counter.
  assert all(s == () or s[0] == 3 for s in r["cache_leaves"]), r["cache_leaves"]


@all_models
def test_cached_decoding_equals_teacher_forcing(name):
  r = results(name)
  np.testing.assert_allclose(r["stepped"][VALID], r["logits"][VALID], atol=1e-5, rtol=1e-5)


@search_models
def test_source_padding_changes_nothing(name):
  r = results(name)
  np.testing.assert_allclose(r["padded"][VALID], r["logits"][VALID], atol=1e-5, rtol=1e-5)


@search_models
def test_packed_rows_equal_separate_sentences(name):
  r = results(name)
  for row, group in enumerate(PACK):
    for s, i in enumerate(group):
      where = P_TGT_SEG[row] == s + 1
      np.testing.assert_allclose(
        r["packed"][row][where],
        r["logits"][i][VALID[i]],
        atol=1e-5,
        rtol=1e-5,
        err_msg=f"row {row} segment {s + 1}",
      )


@pytest.mark.slow
@search_models
def test_causality(name):
  """Logits at target position t see targets[:t] only."""
  r = results(name)
  before = VALID.copy()
  before[:, CHANGED_AT + 1 :] = False
  np.testing.assert_allclose(r["changed"][before], r["logits"][before], atol=1e-5, rtol=1e-5)
  assert not np.allclose(r["changed"][:, CHANGED_AT + 1 :], r["logits"][:, CHANGED_AT + 1 :])


@search_models
def test_search_through_the_cache(name):
  r = results(name)
  greedy, beams, scores = r["greedy"], r["beams"], r["beam_scores"]
  assert greedy.shape == (3, MAX_DECODE) and beams.shape == (3, 3, MAX_DECODE)
  for row, limit in zip(greedy, MAX_LENS):
    length = int(np.sum(row > 0))
    assert 1 <= length <= limit and row[length - 1] == 1 and np.all(row[length:] == 0)
  for hyps, limit in zip(beams, MAX_LENS):
    assert all(np.sum(h > 0) <= limit for h in hyps)
  assert np.all(np.isfinite(scores[:, 0])) and np.all(np.diff(scores, axis=1) <= 0)
  # Greedy picks the teacher-forced argmax wherever it was not forced to EOS.
  tf = r["greedy_tf"].copy()
  tf[..., 0] = -np.inf
  free = (greedy > 0) & (np.arange(MAX_DECODE)[None] + 1 < MAX_LENS[:, None])
  np.testing.assert_array_equal(np.argmax(tf, -1)[free], greedy[free])


@pytest.mark.slow
@search_models
def test_growing_cache_changes_nothing(name):
  """Beam search over self-attention buffers grown 2 positions at a time (decoder-only) finds
  the same hypotheses as over full-length ones; recurrent states have nothing to grow."""
  r = results(name)
  assert bool(r["grows"]) == name.startswith("decoder_only")
  np.testing.assert_array_equal(r["beams_grown"], r["beams"])


@search_models
def test_ensemble_of_copies_searches_as_the_model(name):
  """`decoder_state.ensemble_decoder_state` over every model type's cache (recurrent states, the
  decoder-only rows and positions): two copies of a model find its beam hypotheses."""
  np.testing.assert_array_equal(results(name)["beams_ensemble"], results(name)["beams"])


@pytest.mark.parametrize("name", DECODER_ONLY)
def test_decoder_only_layout(name):
  """The logits are those of `source <sep> target` at the SEP position and after: exactly one per
  target token, so a loss over targets never sees source positions."""
  r = results(name)
  np.testing.assert_allclose(r["logits"][1, : len(TGT[1])], r["by_hand"], atol=1e-5, rtol=1e-5)


@functools.partial(jax.jit, static_argnums=0)
def _references(model, params):
  """`_decoder_only_references` of `model` with parameters `params`."""
  packed = model.apply({"params": params}, P_IN, P_TGT, P_IN_POS, P_TGT_POS, P_IN_SEG, P_TGT_SEG)
  return {"packed": packed, **_decoder_only_references(model, params, packed)}


@pytest.mark.slow
@pytest.mark.parametrize("share", [False, True])
def test_decoder_only_loss_unchanged_by_projecting_targets_only(share):
  """Only the target part is projected to the vocabulary; the loss (and the logits) equal those
  of projecting every source and target position and slicing the target part afterwards; with
  separate and with shared embeddings."""
  if share:  # a one-layer decoder-only model with shared embeddings
    model = _decoder_only(True, True, 1)
    r = _references(model, numpy_params(model, INPUTS, TARGETS, seed=1))
  else:
    r = results(DECODER_ONLY[0])
  logits, old = np.asarray(r["packed"]), np.asarray(r["projected_all"])
  assert logits.shape == old.shape == (2, P_TGT.shape[1], VOCAB)
  np.testing.assert_allclose(r["projected_loss"], r["projected_all_loss"], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(logits, old, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- registry
def _model_cfg(**overrides):
  from configs.common import base_config

  cfg = base_config().model
  cfg.update(dict(vocab_size=VOCAB, d_model=32, num_layers=1))
  cfg.update(overrides)
  return cfg


@pytest.mark.parametrize("kind", MODEL_TYPES)
def test_every_type_builds_from_the_config(kind):
  """build_model, and the DeferredModel that decoding holds: what it knows before it is built
  (kind, config, masks_logits) is the built module's; anything else is the module's own, built
  once."""
  params = abstract_params(_model_cfg(type=kind))
  assert jax.tree_util.tree_leaves(params)
  model = build_model(_model_cfg(type=kind))
  assert hasattr(model, "init_cache") and hasattr(model, "decode_step")
  assert model.kind == kind
  deferred = DeferredModel(_model_cfg(type=kind))
  assert deferred._module is None
  assert (deferred.kind, deferred.config) == (model.kind, model.config)
  assert deferred.masks_logits == getattr(model, "masks_logits", False)
  assert deferred._module is None  # nothing above built it
  assert deferred.module == model and deferred.init_cache == deferred.module.init_cache
  assert deferred.module is deferred.module


def test_unknown_type_lists_valid_types():
  with pytest.raises(ValueError) as err:
    build_model(_model_cfg(type="lstm"))
  for kind in MODEL_TYPES:
    assert kind in str(err.value)


def test_ignored_options_warn_only_when_changed(caplog):
  from model import build

  with caplog.at_level(logging.WARNING):
    for kind in MODEL_TYPES:
      build_model(_model_cfg(type=kind))
  assert not [r for r in caplog.records if "does not apply" in r.getMessage()]
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    build_model(_model_cfg(type="rnn", num_heads=2, rnn_cell="lstm"))
    build_model(_model_cfg(type="transformer", rnn_bidirectional=False))
  messages = [r.getMessage() for r in caplog.records if "does not apply" in r.getMessage()]
  assert len(messages) == 2, messages
  assert "model.num_heads=2" in messages[0] and "'rnn'" in messages[0]
  assert "model.rnn_bidirectional=False" in messages[1]
  # Which options apply to one type only comes from model/config.py's two dataclasses.
  assert set(build._TRANSFORMER_ONLY) == {
    "d_ff",
    "num_heads",
    "attention_dropout_rate",
    "pre_ln",
    "remat",
    "attention_impl",
    "ffn_activation",
    "position_layout",
    "position_frequencies",
    "layer_norm_epsilon",
    "decoder_start",
    "attention_bias",
    "output_bias",
    "raw_self_keys",
  }
  assert build._RNN_ONLY == {"rnn_cell": "gru", "rnn_bidirectional": True}


def test_rnn_config_errors_are_clear():
  with pytest.raises(ValueError, match="model.rnn_cell='rnn'.*gru"):
    RNNConfig(vocab_size=VOCAB, rnn_cell="rnn")
  with pytest.raises(ValueError, match="model.num_layers"):
    RNNConfig(vocab_size=VOCAB, num_layers=0)
  with pytest.raises(ValueError, match="model.vocab_size is required"):
    RNNConfig.from_config({"d_model": 8})
  with pytest.raises(ValueError, match="segmentation"):
    _rnn("gru", True, 1).init(jax.random.key(0), INPUTS, TARGETS, None, None, None, TARGETS > 0)


@pytest.mark.parametrize("kind", MODEL_TYPES)
def test_every_cache_entry_is_of_a_declared_kind(kind):
  """Each model type creates its decoding cache only in model/cache_kinds.py's collections."""
  model = build_model(_model_cfg(type=kind))
  params = abstract_params(_model_cfg(type=kind))
  inputs = jnp.ones((2, 5), jnp.int32)

  def collections(p):
    encoded = model.apply({"params": p}, inputs, method="encode")
    return model.apply({"params": p}, encoded, inputs, 8, method="init_cache", mutable=True)[1]

  found = set(jax.eval_shape(collections, params)) - {"params"}
  assert found and found <= set(cache_kinds.COLLECTIONS), found


class _Mystery(nn.Module):
  """A decoder whose cache has an entry in a collection of no declared kind."""

  config: TransformerConfig = TransformerConfig(vocab_size=VOCAB)

  def encode(self, inputs):
    return jax.nn.one_hot(inputs, VOCAB)

  @nn.compact
  def init_cache(self, encoded, inputs, length):
    self.variable(cache_kinds.STATE, "index", lambda: jnp.int32(0))
    self.variable("mystery", "buffer", lambda: jnp.zeros((inputs.shape[0], length, 8)))

  def decode_step(self, ids):
    return jnp.zeros((ids.shape[0], VOCAB))


def test_a_cache_entry_of_no_declared_kind_is_refused():
  model = _Mystery()
  inputs = jnp.ones((2, 5), jnp.int32)
  with pytest.raises(ValueError, match=r"_Mystery.*\['mystery'\].*model/cache_kinds.py"):
    decoder_state.decoder_state(model, {}, inputs, 8, segment=None)
