"""The decoder step's fused products against the unfused math: the cached decode step (Q, K and V
of self-attention as one product with stacked kernels, K and V of the encoder output as another,
model/layers.py `MultiHeadAttention._project`) gives the logits, greedy ids and beam ids of a
plain reference written here from the parameter tree: one product per projection, no cache (the
whole prefix re-run every step), float32."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import decoder_state, distribution, search
from model.build import build_model, init_variables
from model.special_tokens import EOS_ID
from tests.helpers import tiny_config

VOCAB, SRC_LEN, MAX_LEN = 40, 7, 9


def _layer_norm(p, x, eps=1e-6):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / jnp.sqrt(var + eps) * p["scale"] + p["bias"]


def _attention(p, x, memory, mask, heads):
  """Multi-head attention with one product per projection (W^Q, W^K, W^V, W^O)."""
  d_k = x.shape[-1] // heads
  q = jnp.einsum("bld,dhk->blhk", x, p["query"]["kernel"]) / np.sqrt(d_k)
  k = jnp.einsum("bld,dhk->blhk", memory, p["key"]["kernel"])
  v = jnp.einsum("bld,dhk->blhk", memory, p["value"]["kernel"])
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k)
  weights = jax.nn.softmax(jnp.where(mask, logits, -1e30), axis=-1)
  out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
  return jnp.einsum("bqhd,hdo->bqo", out, p["out"]["kernel"])


def _ffn(p, x):
  h = jax.nn.relu(x @ p["wi"]["kernel"] + p["wi"]["bias"])
  return h @ p["wo"]["kernel"] + p["wo"]["bias"]


def _positions(length, d_model):
  pos = np.arange(length, dtype=np.float64)[:, None]
  angles = pos / 10000 ** (np.arange(0, d_model, 2) / d_model)
  pe = np.zeros((length, d_model))
  pe[:, 0::2], pe[:, 1::2] = np.sin(angles), np.cos(angles)
  return jnp.asarray(pe, jnp.float32)


def reference_all(params, cfg, inputs, prefix):
  """Logits [n, len, vocab] at every position of `prefix` [n, len] (start symbol 0 first;
  position k sees prefix[:, :k + 1]): the post-LN Transformer of the paper from `params`,
  recomputed from scratch."""
  d, heads, emb = cfg.d_model, cfg.num_heads, params["embed"]["embedding"]
  x = emb[inputs] * np.sqrt(d) + _positions(inputs.shape[1], d)
  src_mask = (inputs > 0)[:, None, None, :]
  for i in range(cfg.num_layers):
    p = params["encoder"][f"layer_{i}"]
    attended = _attention(p["self_attention"], x, x, src_mask, heads)
    x = _layer_norm(p["attention_block"]["norm"], x + attended)
    x = _layer_norm(p["ffn_block"]["norm"], x + _ffn(p["ffn"], x))
  t = prefix.shape[1]
  y = emb[prefix] * np.sqrt(d) + _positions(t, d)
  causal = jnp.tril(jnp.ones((t, t), bool))[None, None]
  for i in range(cfg.num_layers):
    p = params["decoder"][f"layer_{i}"]
    attended = _attention(p["self_attention"], y, y, causal, heads)
    y = _layer_norm(p["self_attention_block"]["norm"], y + attended)
    attended = _attention(p["cross_attention"], y, x, src_mask, heads)
    y = _layer_norm(p["cross_attention_block"]["norm"], y + attended)
    y = _layer_norm(p["ffn_block"]["norm"], y + _ffn(p["ffn"], y))
  return distribution.mask(y @ emb.T)


def _reference_step(params, cfg):
  """model/search.py step function over the reference: the state holds each row's source and
  its tokens so far in a [n, MAX_LEN] buffer (reordered with the beams like any cache); the
  causal mask keeps the buffer's unwritten end out of position t."""

  def step(ids, state):
    t, prefix = state["t"], state["prefix"]
    prefix = jnp.where(jnp.arange(prefix.shape[1]) == t, ids, prefix)
    logits = reference_all(params, cfg, state["inputs"], prefix)[:, t]
    return logits, {"inputs": state["inputs"], "prefix": prefix, "t": t + 1}

  return step


@pytest.fixture(scope="module")
def setup():
  config = tiny_config(**{"model.num_layers": 2, "model.vocab_size": VOCAB})
  model = build_model(config.model)
  init = jax.jit(lambda key: nn.unbox(init_variables(model, key))["params"])  # one program
  params = init(jax.random.key(3))
  rng = np.random.default_rng(0)
  inputs = rng.integers(4, VOCAB, size=(3, SRC_LEN)).astype(np.int32)
  inputs[:, -1] = EOS_ID
  inputs[1, 4:] = 0  # a padded row
  inputs[1, 3] = EOS_ID
  return model, params, jnp.asarray(inputs)


def test_decode_step_logits_match_unfused_reference(setup):
  """The cached step's logits at every position, fed random tokens, equal the reference's at that
  position of the prefix so far (the -inf of masked ids at the same places)."""
  model, params, inputs = setup
  cfg = model.config
  rows = inputs.shape[0]
  rng = np.random.default_rng(1)
  fed = np.zeros((MAX_LEN, rows, 1), np.int32)  # step t is fed fed[t]: 0 (start), then random
  for t in range(1, MAX_LEN):
    fed[t] = rng.integers(4, VOCAB, size=(rows, 1))

  @jax.jit
  def fused(params, inputs, fed):
    """The logits of each step of the cached decoder fed `fed`, [MAX_LEN, rows, vocab]."""
    state = decoder_state.decoder_state(model, params, inputs, MAX_LEN, segment=None)
    step = lambda cache, ids: state.step(ids, cache)[::-1]
    return jax.lax.scan(step, state.cache, fed)[1]

  got = np.asarray(fused(params, inputs, fed))
  reference = jax.jit(reference_all, static_argnums=1)
  prefix = np.zeros((rows, MAX_LEN), np.int32)  # causal: the end is not seen
  for t in range(MAX_LEN):
    prefix[:, t] = fed[t, :, 0]
    want = np.asarray(reference(params, cfg, inputs, prefix)[:, t])
    finite = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got[t]), finite)
    np.testing.assert_allclose(got[t][finite], want[finite], atol=2e-5)


def _searches(step, cache, rows, grow=None, segment=None):
  greedy = search.greedy_search(step, cache, rows, MAX_LEN, grow=grow, segment=segment)
  beams, _ = search.beam_search(step, cache, rows, MAX_LEN, beam_size=3, grow=grow, segment=segment)
  return greedy, beams


def test_greedy_and_beam_ids_match_unfused_reference(setup):
  """Greedy and beam-3 search over the cached step (self-attention buffers grown from 4
  positions) find the ids they find over the reference's step."""
  model, params, inputs = setup
  cfg = model.config
  rows = inputs.shape[0]

  @jax.jit
  def fused(params, inputs):
    state = decoder_state.decoder_state(model, params, inputs, MAX_LEN, segment=4)
    return _searches(state.step, state.cache, rows, state.grow, state.segment)

  @jax.jit
  def unfused(params, inputs):
    start = {"inputs": inputs, "prefix": jnp.zeros((rows, MAX_LEN), jnp.int32), "t": jnp.int32(0)}
    return _searches(_reference_step(params, cfg), start, rows)

  got, want = fused(params, inputs), unfused(params, inputs)
  np.testing.assert_array_equal(got[0], want[0])
  np.testing.assert_array_equal(got[1], want[1])
