"""The model's mathematics against independent NumPy references and the paper's invariants."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import attention, cache_kinds, decoder_state, distribution, masks, output_table
from model.build import build_model
from model.config import TransformerConfig
from model.layers import sinusoidal_encoding
from model.loss import smoothed_cross_entropy, token_accuracy
from model.transformer import Transformer, shift_right
from tests.helpers import numpy_params, random_params, run_in_process, run_py, tiny_config

TINY = TransformerConfig(
  vocab_size=40, d_model=32, d_ff=64, num_heads=4, num_layers=2, dropout_rate=0.0, max_len=64
)


# ----------------------------------------------------------------------------- references
# Compiling dominates this file's time: each function below compiles once per shape (an eager
# call compiles each of its operations on its own).
_attention = jax.jit(attention.dot_product_attention)


def np_attention(q, k, v, mask):
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
  mask = np.broadcast_to(mask, logits.shape)
  logits = np.where(mask, logits, -np.inf)
  mx = np.max(np.where(mask, logits, -1e300), axis=-1, keepdims=True)
  e = np.where(mask, np.exp(logits - mx), 0.0)
  denom = e.sum(-1, keepdims=True)
  w = np.where(denom > 0, e / np.where(denom > 0, denom, 1), 0.0)
  return np.einsum("bhqk,bkhd->bqhd", w, v)


@pytest.mark.parametrize("b,lq,lk,h,d", [(1, 1, 1, 1, 4), (2, 5, 7, 4, 8), (3, 9, 4, 2, 16)])
def test_attention_matches_float64_reference(b, lq, lk, h, d):
  rng = np.random.default_rng(b * 100 + lq)
  q, k, v = (
    rng.normal(size=s).astype(np.float32) for s in ((b, lq, h, d), (b, lk, h, d), (b, lk, h, d))
  )
  mask = rng.random((b, 1, lq, lk)) > 0.4
  mask[0, 0, 0, :] = False  # one fully masked query row
  out = _attention(q, k, v, mask)
  ref = np_attention(q, k, v, mask)
  assert np.all(np.isfinite(out))
  np.testing.assert_allclose(out, ref, atol=2e-5, rtol=1e-4)
  np.testing.assert_array_equal(np.asarray(out)[0, 0], 0.0)
  # No mask at all.
  np.testing.assert_allclose(_attention(q, k, v), np_attention(q, k, v, True), atol=2e-5, rtol=1e-4)


def test_cached_attention_over_float32_bfloat16_values_rounds_as_bfloat16():
  """The bfloat16 self-attention cache is kept as float32 (model/layers.py): attending over it
  gives exactly what attending over the same keys and values as bfloat16 gives, under jit (where
  XLA may drop a round trip through bfloat16 written as `astype`), in the query's dtype."""
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(6, 1, 4, 32)), jnp.bfloat16)
  k, v = (jnp.asarray(rng.normal(size=(6, 4, 40, 32)), jnp.bfloat16) for _ in range(2))
  mask = np.arange(40) <= np.arange(6)[:, None, None, None] * 7
  run = jax.jit(attention.cached_attention)
  as_bf16 = run(q, k, v, mask)
  as_f32 = run(q, np.asarray(k, np.float32), np.asarray(v, np.float32), mask)  # exact widening
  assert as_bf16[0].dtype == as_f32[0].dtype == jnp.bfloat16
  for a, b in zip(as_bf16, as_f32):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_masks_match_reference():
  rng = np.random.default_rng(0)
  tgt = np.array([[5, 6, 7, 0, 0], [3, 4, 5, 6, 8]])
  src = np.array([[9, 9, 0], [1, 2, 3]])
  tseg = np.array([[1, 1, 2, 0, 0], [1, 1, 1, 2, 2]])
  sseg = np.array([[1, 2, 0], [1, 1, 2]])
  pad = (tgt > 0)[:, None, :, None] & (tgt > 0)[:, None, None, :]
  np.testing.assert_array_equal(masks.padding_mask(tgt, tgt), pad)
  causal = np.array([[j <= i for j in range(5)] for i in range(5)])
  np.testing.assert_array_equal(masks.causal_mask(5)[0, 0], causal)
  seg = tseg[:, None, :, None] == tseg[:, None, None, :]
  np.testing.assert_array_equal(masks.decoder_self_mask(tgt, tseg), pad & causal & seg)
  enc = (
    (src > 0)[:, None, :, None]
    & (src > 0)[:, None, None, :]
    & (sseg[:, None, :, None] == sseg[:, None, None, :])
  )
  np.testing.assert_array_equal(masks.encoder_self_mask(src, sseg), enc)
  cross = (
    (tgt > 0)[:, None, :, None]
    & (src > 0)[:, None, None, :]
    & (tseg[:, None, :, None] == sseg[:, None, None, :])
  )
  np.testing.assert_array_equal(masks.cross_mask(tgt, src, tseg, sseg), cross)
  assert masks.combine_masks(None, None) is None
  del rng


def test_positional_encoding_formula():
  pos = np.array([[0, 1, 2, 7], [3, 0, 1, 2]])
  pe = np.asarray(jax.jit(sinusoidal_encoding, static_argnums=1)(pos, 16))
  i = np.arange(8)
  for b in range(2):
    for t in range(4):
      np.testing.assert_allclose(
        pe[b, t, 0::2], np.sin(pos[b, t] / 10000 ** (2 * i / 16)), atol=1e-5
      )
      np.testing.assert_allclose(
        pe[b, t, 1::2], np.cos(pos[b, t] / 10000 ** (2 * i / 16)), atol=1e-5
      )


def test_shift_right_restarts_each_segment():
  tgt = jnp.array([[5, 6, 1, 7, 1, 0]])
  seg = jnp.array([[1, 1, 1, 2, 2, 0]])
  np.testing.assert_array_equal(shift_right(tgt), [[0, 5, 6, 1, 7, 1]])
  np.testing.assert_array_equal(shift_right(tgt, seg), [[0, 5, 6, 0, 7, 0]])


_xent = jax.jit(smoothed_cross_entropy, static_argnums=3)
_xent_grad = jax.jit(jax.grad(lambda *a: smoothed_cross_entropy(*a)[0]), static_argnums=3)
_accuracy = jax.jit(token_accuracy)


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_label_smoothed_loss_matches_one_hot_reference(eps):
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(2, 3, 7)).astype(np.float32)
  tgt = rng.integers(0, 7, (2, 3))
  w = np.array([[1, 1, 0], [1, 0, 0]], np.float32)
  logp = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
  q = np.full((2, 3, 7), eps / 6)
  np.put_along_axis(q, tgt[..., None], 1 - eps, axis=-1)
  ent = -(q * np.log(np.where(q > 0, q, 1))).sum(-1)
  ref = ((-(q * logp).sum(-1) - ent) * w).sum()
  loss, n = _xent(logits, tgt, w, eps)
  np.testing.assert_allclose(loss, ref, rtol=1e-5)
  assert float(n) == 3.0
  # Its gradient is (softmax - q) on weighted positions.
  grad = _xent_grad(logits, tgt, w, eps)
  np.testing.assert_allclose(grad, (np.exp(logp) - q) * w[..., None], rtol=1e-4, atol=1e-6)
  correct, n = _accuracy(logits, tgt, w)
  assert float(correct) == float(((logits.argmax(-1) == tgt) * w).sum())
  # A tie for the largest logit counts as correct.
  tie, _ = _accuracy(np.zeros((1, 2, 7), np.float32), np.asarray([[3, 0]]))
  assert float(tie) == 2.0
  # bfloat16 rounds 1.0 and 1.001 to one value: the arg-max decides, as greedy decoding would.
  near = jnp.asarray([[[1.0, 1.001, 0.0]]], jnp.bfloat16)
  assert float(_accuracy(near, np.asarray([[1]]))[0]) == 0.0
  assert float(_accuracy(near, np.asarray([[0]]))[0]) == 1.0
  # The minimum (predicting q exactly) is zero.
  best, _ = _xent(np.log(q.astype(np.float32) + np.float32(1e-30)), tgt, None, eps)
  assert abs(float(best)) < 1e-4


# ----------------------------------------------------------------------------- the model
@pytest.fixture(scope="module")
def tiny():
  model = Transformer(TINY)
  rng = np.random.default_rng(0)
  inputs = rng.integers(2, 40, (2, 9)).astype(np.int32)
  targets = rng.integers(2, 40, (2, 7)).astype(np.int32)
  params = numpy_params(model, inputs, targets)
  jitted = jax.jit(lambda p, *a: model.apply({"params": p}, *a))
  apply = lambda *a: np.asarray(jitted(*a))  # numpy: its slices compile nothing
  return model, params, apply, inputs, targets


@pytest.mark.slow
def test_causality(tiny):
  model, params, apply, inputs, targets = tiny
  base = apply(params, inputs, targets)
  for t in range(targets.shape[1]):
    changed = targets.copy()
    changed[:, t] = (targets[:, t] + 7) % 38 + 2
    out = apply(params, inputs, changed)
    np.testing.assert_array_equal(out[:, : t + 1], base[:, : t + 1])  # t predicts token t from < t
    if t + 1 < targets.shape[1]:
      assert not np.allclose(out[:, t + 1 :], base[:, t + 1 :])


def test_padding_never_leaks(tiny):
  model, params, apply, inputs, targets = tiny
  padded = inputs.copy()
  padded[:, 6:] = 0
  base = apply(params, padded, targets)

  @jax.jit
  def poked(params):  # anything at all in the encoder output behind padding
    encoded = model.apply({"params": params}, padded, method=Transformer.encode)
    noise = 1e3 * jax.random.normal(jax.random.key(3), encoded[:, 6:].shape)
    poked = encoded.at[:, 6:].set(noise)
    return model.apply({"params": params}, poked, padded, targets, method=Transformer.decode)

  # More padding, or anything at all in the encoder output behind padding: same logits.
  np.testing.assert_allclose(
    apply(params, np.pad(padded, ((0, 0), (0, 5))), targets), base, atol=1e-5
  )
  np.testing.assert_allclose(poked(params), base, atol=1e-5)


def test_packed_rows_equal_separate_sentences(tiny):
  model, params, apply, _, _ = tiny
  a_src, a_tgt = [5, 6, 7, 1], [8, 9, 1]
  b_src, b_tgt = [10, 11, 1], [12, 13, 14, 15, 1]
  pack = lambda x, y: np.asarray([x + y + [0] * (10 - len(x) - len(y))], np.int32)
  seg = lambda x, y: np.asarray([[1] * len(x) + [2] * len(y) + [0] * (10 - len(x) - len(y))])
  pos = lambda x, y: np.asarray(
    [list(range(len(x))) + list(range(len(y))) + [0] * (10 - len(x) - len(y))]
  )
  packed = apply(
    params,
    pack(a_src, b_src),
    pack(a_tgt, b_tgt),
    pos(a_src, b_src),
    pos(a_tgt, b_tgt),
    seg(a_src, b_src),
    seg(a_tgt, b_tgt),
  )
  # Each sentence alone in its own row, padded to the other tests' shapes (their program).
  rows = lambda x, y, n: np.asarray([x + [0] * (n - len(x)), y + [0] * (n - len(y))], np.int32)
  alone = apply(params, rows(a_src, b_src, 9), rows(a_tgt, b_tgt, 7))
  np.testing.assert_allclose(packed[0, :3], alone[0, :3], atol=1e-5)
  np.testing.assert_allclose(packed[0, 3:8], alone[1, :5], atol=1e-5)


def test_cached_decoding_equals_full_decoding(tiny):
  model, params, apply, inputs, targets = tiny
  full = apply(params, inputs, targets)

  @jax.jit
  def initial_cache(params):
    encoded = model.apply({"params": params}, inputs, method=Transformer.encode)
    return model.apply(
      {"params": params},
      encoded,
      inputs,
      targets.shape[1],
      method=Transformer.init_cache,
      mutable=cache_kinds.COLLECTIONS,
    )[1]

  v = initial_cache(params)
  source = {cache_kinds.SOURCE: v[cache_kinds.SOURCE]}
  cache = {kind: v[kind] for kind in cache_kinds.CARRIED}
  step = jax.jit(
    lambda p, c, ids: model.apply(
      {"params": p, **source, **c},
      ids,
      method=Transformer.decode_step,
      mutable=cache_kinds.CARRIED,
    )
  )
  prev = np.pad(targets, ((0, 0), (1, 0)))[:, :-1]  # the decoder's inputs: targets shifted right
  steps = []
  for t in range(targets.shape[1]):
    logits, cache = step(params, cache, prev[:, t : t + 1])
    steps.append(logits)
  assert np.max(np.abs(np.stack(steps, 1) - full)) <= 1e-5


@pytest.mark.parametrize(
  "config,paper", [("configs/wmt14_ende_base.py", 65e6), ("configs/wmt14_ende_big.py", 213e6)]
)
def test_parameter_counts_match_paper(config, paper):
  """cli.parameters: the base model's count in a real process, the big one's in this one."""
  flags = (f"--config={config}",)
  run = run_py("-m", "cli.parameters", *flags) if "base" in config else None
  run = run or run_in_process("cli.parameters", *flags)
  assert run.returncode == 0, run.stderr[-2000:]
  out = run.stdout
  last = out.strip().splitlines()[-1]
  assert last.startswith("params: ")
  n = int(last.split()[1])
  assert abs(n - paper) / paper < 0.05, n
  # Exactly (the README's figures): no attention biases, tied embeddings and output projection.
  assert (
    n
    == {"configs/wmt14_ende_base.py": 63_045_632, "configs/wmt14_ende_big.py": 214_171_648}[config]
  )


@pytest.mark.slow
@pytest.mark.parametrize("pre_ln,dtype", [(True, "bfloat16")])
def test_forward_backward_finite(pre_ln, dtype):
  cfg = TransformerConfig(
    **{
      **TINY.__dict__,
      "pre_ln": pre_ln,
      "dtype": dtype,
      "num_layers": 1,
      "dropout_rate": 0.1,
      "attention_dropout_rate": 0.1,
    }
  )
  model = Transformer(cfg)
  inputs = np.ones((2, 6), np.int32)
  targets = np.full((2, 5), 3, np.int32)

  def loss_fn(p):
    logits = model.apply(
      {"params": p}, inputs, targets, deterministic=False, rngs={"dropout": jax.random.key(1)}
    )
    assert logits.dtype == cfg.compute_dtype
    return smoothed_cross_entropy(logits, targets, None, 0.1)[0]

  # The parameters `model.init` makes are float32 (its types, traced only)...
  initialized = jax.eval_shape(model.init, jax.random.key(0), inputs, targets)["params"]
  assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(nn.unbox(initialized)))
  # ... and such parameters give a finite loss and gradients (forward and backward compiled).
  loss, grads = jax.jit(jax.value_and_grad(loss_fn))(numpy_params(model, inputs, targets))
  assert np.isfinite(loss)
  assert all(np.all(np.isfinite(g)) for g in jax.tree_util.tree_leaves(grads))


# ----------------------------------------------------------------------------- dropout
@pytest.mark.parametrize("rate", [0.1, 0.3])
def test_dropout_masks_keep_the_rate_independently_of_position_and_key(rate):
  from model.dropout import keep_mask

  shape = (64, 128, 128)  # 1M elements: the standard error of a fraction is <= 0.0005
  masks = jax.jit(keep_mask, static_argnums=(1, 2))
  a = np.asarray(masks(jax.random.key(0), rate, shape))
  b = np.asarray(masks(jax.random.key(1), rate, shape))
  p, tol = 1.0 - rate, 0.003
  assert abs(a.mean() - p) < tol and abs(b.mean() - p) < tol
  # Independent across keys and between neighbours along every axis: P(both kept) = p².
  assert abs((a & b).mean() - p * p) < tol
  for axis in range(3):
    x, y = np.moveaxis(a, axis, 0)[:-1], np.moveaxis(a, axis, 0)[1:]
    assert abs((x & y).mean() - p * p) < tol, axis
  # No row, column or element is fixed by its position: every slice keeps about p.
  for axis in range(3):
    per_slice = a.mean(axis=tuple(i for i in range(3) if i != axis))
    assert np.all(np.abs(per_slice - p) < 0.03), axis
  # A pure function of (key, shape).
  np.testing.assert_array_equal(a, np.asarray(masks(jax.random.key(0), rate, shape)))


def test_dropout_scales_kept_values_and_rejects_a_bad_rate():
  from model.dropout import Dropout, dropout

  x = jnp.arange(1.0, 1001.0, dtype=jnp.bfloat16).reshape(10, 100)
  y = jax.jit(dropout, static_argnums=1)(x, 0.2, jax.random.key(3))
  assert y.dtype == x.dtype and y.shape == x.shape
  kept = np.asarray(y != 0)
  np.testing.assert_array_equal(
    np.asarray(y)[kept], np.asarray(x / jnp.asarray(0.8, jnp.bfloat16))[kept]
  )
  assert dropout(x, 0.0, jax.random.key(3)) is x
  assert Dropout(0.5).apply({}, x, deterministic=True) is x
  with pytest.raises(ValueError, match=r"dropout: rate must be in \[0, 1\), got 1.0"):
    dropout(x, 1.0, jax.random.key(3))


def np_transformer_one_layer(params, inputs, targets, d_model):
  """A float64 NumPy forward pass of a one-layer, post-LN, tied-embedding Transformer, written
  from the paper (sections 3.1-3.5): logits [batch, tgt_len, vocab]."""
  p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
  table = p["embed"]["embedding"]

  def norm(x, q):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-6) * q["scale"] + q[
      "bias"
    ]

  def positions(length):
    angle = np.arange(length)[:, None] / 10000 ** (np.arange(0, d_model, 2) / d_model)
    pe = np.zeros((length, d_model))
    pe[:, 0::2], pe[:, 1::2] = np.sin(angle), np.cos(angle)
    return pe

  def mha(q, x, memory, mask):
    heads = [
      np.einsum("bld,dhk->blhk", src, q[n]["kernel"])
      for n, src in (("query", x), ("key", memory), ("value", memory))
    ]
    return np.einsum("blhk,hkd->bld", np_attention(*heads, mask), q["out"]["kernel"])

  def ffn(q, x):
    h = np.maximum(x @ q["wi"]["kernel"] + q["wi"]["bias"], 0)
    return h @ q["wo"]["kernel"] + q["wo"]["bias"]

  src_ok, tgt_ok = inputs > 0, targets > 0
  enc, dec = p["encoder"]["layer_0"], p["decoder"]["layer_0"]
  x = table[inputs] * np.sqrt(d_model) + positions(inputs.shape[1])
  x = norm(
    x + mha(enc["self_attention"], x, x, (src_ok[:, None, :, None] & src_ok[:, None, None, :])),
    enc["attention_block"]["norm"],
  )
  x = norm(x + ffn(enc["ffn"], x), enc["ffn_block"]["norm"])
  shifted = np.pad(targets, ((0, 0), (1, 0)))[:, :-1]
  y = table[shifted] * np.sqrt(d_model) + positions(targets.shape[1])
  causal = np.tril(np.ones((targets.shape[1],) * 2, bool))[None, None]
  y = norm(
    y + mha(dec["self_attention"], y, y, causal & tgt_ok[:, None, :, None]),
    dec["self_attention_block"]["norm"],
  )
  y = norm(
    y + mha(dec["cross_attention"], y, x, tgt_ok[:, None, :, None] & src_ok[:, None, None, :]),
    dec["cross_attention_block"]["norm"],
  )
  y = norm(y + ffn(dec["ffn"], y), dec["ffn_block"]["norm"])
  return y @ table.T


def test_one_layer_forward_matches_numpy_reference():
  cfg = TransformerConfig(**{**TINY.__dict__, "num_layers": 1})
  model = Transformer(cfg)
  inputs = np.array([[5, 9, 7, 12, 1], [8, 3, 1, 0, 0]], np.int32)
  targets = np.array([[6, 11, 4, 1], [13, 1, 0, 0]], np.int32)
  params = numpy_params(model, inputs, targets)
  rng = np.random.default_rng(0)  # move every parameter (LayerNorm scales and biases included)
  params = jax.tree_util.tree_map(
    lambda a: (np.asarray(a) + 0.3 * rng.standard_normal(a.shape)).astype(np.float32), params
  )
  got = np.asarray(jax.jit(model.apply)({"params": params}, inputs, targets))
  want = np_transformer_one_layer(params, inputs, targets, cfg.d_model)
  ok = targets > 0
  np.testing.assert_allclose(got[ok], want[ok], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_remat_gives_same_gradients():
  inputs = np.asarray([[4, 5, 6, 1]], np.int32)
  targets = np.asarray([[7, 8, 1]], np.int32)
  models = [
    Transformer(TransformerConfig(**{**TINY.__dict__, "remat": remat, "num_layers": 1}))
    for remat in (False, True)
  ]
  losses = [
    lambda p, model=model: smoothed_cross_entropy(
      model.apply({"params": p}, inputs, targets), targets
    )[0]
    for model in models
  ]

  params = numpy_params(models[0], inputs, targets)  # the same tree for both models
  grads = []
  for remat, f in zip((False, True), losses):
    traced = jax.jit(jax.grad(f)).trace(params)  # the program whose gradients are compared
    jaxpr = str(traced.jaxpr)
    assert ("checkpoint" in jaxpr or "remat" in jaxpr) == remat
    grads.append(traced.lower().compile()(params))
  for a, b in zip(jax.tree_util.tree_leaves(grads[0]), jax.tree_util.tree_leaves(grads[1])):
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_unshared_embeddings_have_own_output_layer():
  model = Transformer(TransformerConfig(**{**TINY.__dict__, "share_embeddings": False}))
  ids = jax.ShapeDtypeStruct((1, 3), jnp.int32)
  params = jax.eval_shape(model.init, jax.random.key(0), ids, ids)["params"]  # the tree only
  assert "target_embed" in params and "logits" in params["decoder"]


# ----------------------------------------------------------------------------- bad input
def test_bad_shapes_raise_value_errors_naming_arguments():
  """The shapes are checked before anything is computed: NumPy arguments, and the model's
  initialization traced abstractly (`jax.eval_shape`), raise the same errors as eager calls."""
  q = np.ones((2, 3, 4, 8), np.float32)
  with pytest.raises(ValueError, match="query, key and value"):
    attention.dot_product_attention(q[0], q, q)
  with pytest.raises(ValueError, match="mismatched shapes"):
    attention.dot_product_attention(q, np.ones((2, 3, 4, 6), np.float32), q)
  with pytest.raises(ValueError, match="mask shape"):
    attention.dot_product_attention(q, q, q, np.ones((2, 1, 5, 3), bool))
  with pytest.raises(ValueError, match="padding_mask: batch sizes differ"):
    masks.padding_mask(np.ones((2, 3)), np.ones((3, 3)))
  init = lambda *a, **k: jax.eval_shape(Transformer(TINY).init, jax.random.key(0), *a, **k)
  with pytest.raises(ValueError, match="inputs must be \\[batch, length\\]"):
    init(np.ones((3,), np.int32), np.ones((1, 3), np.int32))
  with pytest.raises(ValueError, match="batch sizes differ"):
    init(np.ones((2, 3), np.int32), np.ones((1, 3), np.int32))
  with pytest.raises(ValueError, match="targets_segmentation shape"):
    init(
      np.ones((1, 3), np.int32),
      np.ones((1, 3), np.int32),
      targets_segmentation=np.ones((1, 4), np.int32),
    )
  with pytest.raises(ValueError, match="loss: logits"):
    smoothed_cross_entropy(np.ones((2, 3, 5), np.float32), np.ones((2, 4), np.int32))


def test_config_errors_are_clear():
  with pytest.raises(ValueError, match="model.d_model=30.*divisible by model.num_heads=4"):
    TransformerConfig(vocab_size=10, d_model=30, num_heads=4)
  with pytest.raises(ValueError, match="model.dtype"):
    TransformerConfig(vocab_size=10, d_model=32, num_heads=4, dtype="float64x")
  with pytest.raises(ValueError, match=r"model.d_model=9: must be even \(the sinusoidal"):
    TransformerConfig(vocab_size=10, d_model=9, num_heads=3)
  with pytest.raises(
    ValueError,
    match=r"model.attention_impl='cudnn': .* multiple of 8 .* "
    r"d_k = 40 / 4 = 10",
  ):
    TransformerConfig(
      vocab_size=10, d_model=40, num_heads=4, dtype="bfloat16", attention_impl="cudnn"
    )
  TransformerConfig(
    vocab_size=10, d_model=64, num_heads=4, dtype="bfloat16", attention_impl="cudnn"
  )
  from model.build import build_model

  with pytest.raises(ValueError, match="model.type='lstm9' is unknown; valid types: transformer"):
    build_model({"type": "lstm9", "vocab_size": 10})
  out = run_in_process(
    "cli.parameters",
    "--config=configs/tiny.py",
    "--config.model.vocab_size=50",
    "--config.model.no_such_field=3",
  )
  assert out.returncode == 2
  assert "unknown config field 'config.model.no_such_field'" in out.stderr
  assert "Traceback" not in out.stderr


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_position_shared_by_all_rows_steps_as_one_per_row(dtype):
  """A decoding step whose cache counts one position for all rows (a search's) encodes that
  position once; its logits are those of the same step with each row's own counters
  (continuous batching's [batch] counters, all equal), to the bit, at steps 0 to 3."""
  config = tiny_config(**{"model.d_model": 64, "model.vocab_size": 50}).model.to_dict()
  model = build_model(dict(config, dtype=dtype))
  params = random_params(config, 3)
  rng = np.random.default_rng(3)
  inputs = jnp.asarray(rng.integers(3, 50, (6, 7)), jnp.int32)
  ids = jnp.asarray(rng.integers(3, 50, (6, 4)), jnp.int32)

  @jax.jit
  def both(params, inputs, ids):
    cache = decoder_state.initial_cache(model, params, inputs, 8)
    carried = {kind: cache[kind] for kind in cache_kinds.CARRIED}
    rows = jax.tree_util.tree_map(lambda x: jnp.full((6,), x) if x.ndim == 0 else x, carried)

    def step(carried, ids):  # [6] ids -> (carried, logits)
      return model.apply(
        {"params": params, **cache, **carried},
        ids[:, None],
        method="decode_step",
        mutable=cache_kinds.CARRIED,
      )[::-1]

    def steps(both, ids):  # a search's loop: steps 0 to 3 run by one traced step
      (carried, a), (rows, b) = step(both[0], ids), step(both[1], ids)
      return (carried, rows), (a, b)

    return jax.lax.scan(steps, (carried, rows), ids.T)[1]

  shared, per_row = (np.asarray(x) for x in both(params, inputs, ids))
  assert shared.shape == (4, 6, 50)
  for t in range(4):
    assert np.array_equal(shared[t], per_row[t]), t


@pytest.mark.parametrize(
  "dtype,shared", [("float32", True), ("bfloat16", True), ("int8", True), ("float32", False)]
)
def test_a_masked_step_is_the_searches_mask_of_the_step(dtype, shared):
  """`decode_step(masked=True, num_ids=)` (the searches' step, the mask folded into the output
  product) against `distribution.mask` of the plain step's logits at the width and row counts of
  real searches (d_model 128, 5 and 80 rows): the impossible ids at -inf, the others the same
  sums to within 8 float32 epsilons of the largest logit (the folded table is read transposed,
  [d_model + 1, vocab], which a float32 product sums in another order: logits near 0 then differ
  by many ulp but little in value; 2.8 epsilons at 5 rows on the AMX Xeon, the same bits at 80),
  and equal to the bit where the mask comes after the product (an int8 table, an output layer of
  its own). With the table folded once
  (`output_table.fold_tables`, for num_ids None): the same values as the step folding it itself
  (to the bit), and a step with another mask folds its own."""
  overrides = {"model.d_model": 128, "model.d_ff": 256, "model.vocab_size": 8000}
  config = tiny_config(**overrides, **{"model.share_embeddings": shared}).model.to_dict()
  rng = np.random.default_rng(7)
  params = random_params(config, 7)
  model = build_model(dict(config, dtype=dtype))
  params = decoder_state.matrices_for_decoding(model, params)
  folded = output_table.fold_tables(model, params, None)
  assert (folded is params) == (dtype == "int8" or not shared)
  on_device = jax.jit(lambda p: output_table.fold_tables(model, p, None))(params)  # in a program
  leaves = jax.tree_util.tree_leaves
  assert len(leaves(on_device)) == len(leaves(folded))  # numpy's and jax's folds, bits included
  assert all(np.array_equal(np.asarray(a), b) for a, b in zip(leaves(on_device), leaves(folded)))
  cuts = (None, 7000)

  @jax.jit
  def both(params, folded, inputs, ids):
    def step(params, cache, **kw):
      return model.apply(
        {"params": params, **cache}, ids, **kw, method="decode_step", mutable=cache_kinds.CARRIED
      )[0]

    # Each tree's own cache (its source encoded once), read by each of its steps.
    cache = decoder_state.initial_cache(model, params, inputs, 4)
    folded_cache = decoder_state.initial_cache(model, folded, inputs, 4)
    plain = step(params, cache)
    return [
      (
        distribution.mask(plain, n),
        step(params, cache, masked=True, num_ids=n),
        step(folded, folded_cache, masked=True, num_ids=n),
      )
      for n in cuts
    ]

  for rows in (5, 80):
    inputs = jnp.asarray(rng.integers(3, 8000, (rows, 9)), jnp.int32)
    ids = jnp.asarray(rng.integers(3, 8000, (rows, 1)), jnp.int32)
    for n, (want, got, once) in zip(cuts, both(params, folded, inputs, ids)):
      want, got = np.asarray(want), np.asarray(got)
      never = np.asarray(distribution.impossible(8000, n))
      assert got.dtype == np.float32 and never[0] and never[7000:].all() == (n == 7000)
      assert np.isneginf(got[:, never]).all() and np.isfinite(got[:, ~never]).all()
      bound = 8 * np.finfo(np.float32).eps * np.abs(want[:, ~never]).max()
      np.testing.assert_allclose(got[:, ~never], want[:, ~never], rtol=0, atol=bound)
      if dtype == "int8" or not shared:  # masked after the product: the very same values
        assert np.array_equal(want, got), (rows, n)
      assert np.array_equal(np.asarray(once), got), (rows, n)
