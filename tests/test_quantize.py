"""int8 products (model/quantize.py): the quantization, the product against a numpy computation of
CTranslate2's int8 rule, its uint8 form (model/uint8_product.py) to the same bits, which axes each
matrix is quantized over, and a model decoding with them (model.dtype 'int8') against the same
model in float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from model import decoder_state
from model.build import build_model
from model.quantize import Int8Matrix, dequantize, int8_product, quantize, quantize_matrices
from model.uint8_product import uint8_int8_product
from tests.helpers import random_params, tiny_config

CONFIG = tiny_config(**{"model.num_layers": 2}).model.to_dict()  # d_model 32, 4 heads, d_ff 64
VOCAB = CONFIG["vocab_size"]


def _np_int8_product(x, w):
  """x [m, k] @ w [k, n] as CTranslate2's int8: x per row, w per column, symmetric, 127 levels;
  integer sums in int64."""

  def q(a, axis):
    scale = np.abs(a).max(axis=axis, keepdims=True) / np.float32(127)
    return np.clip(np.round(a / scale), -127, 127).astype(np.int64), scale

  xq, sx = q(x, 1)
  wq, sw = q(w, 0)
  return (xq @ wq).astype(np.float32) * sx * sw


def test_quantize_keeps_each_entry_within_half_a_step():
  w = np.random.default_rng(0).standard_normal((16, 3, 8)).astype(np.float32)
  w[:, 1, 2] = 0.0  # an all-zero channel
  m = quantize(jnp.asarray(w), (0,))
  assert m.values.dtype == jnp.int8 and m.scale.shape == (1, 3, 8)
  assert np.asarray(m.scale)[0, 1, 2] == 1.0 and not np.asarray(m.values)[:, 1, 2].any()
  assert np.abs(np.asarray(m.values)).max() == 127
  step = np.asarray(m.scale)
  assert np.all(np.abs(np.asarray(dequantize(m)) - w) <= step / 2 + 1e-7)


def test_the_int8_product_is_ctranslate2s_rule():
  rng = np.random.default_rng(1)
  x = rng.standard_normal((6, 5, 24)).astype(np.float32)
  w = rng.standard_normal((24, 10)).astype(np.float32)
  got = int8_product("bld,df->blf", jnp.asarray(x), quantize(jnp.asarray(w), (0,)))
  want = _np_int8_product(x.reshape(30, 24), w).reshape(6, 5, 10)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
  exact = x @ w
  assert np.abs(np.asarray(got) - exact).max() < 0.03 * np.abs(exact).max()


def test_the_int8_product_over_two_summed_axes_and_its_errors():
  """W^O's product sums heads and d_k (`blhk,hkd->bld`); a matrix quantized over other axes
  than the product sums, or subscripts in another order, are refused."""
  rng = np.random.default_rng(2)
  x = rng.standard_normal((2, 3, 4, 8)).astype(np.float32)
  w = rng.standard_normal((4, 8, 16)).astype(np.float32)
  got = int8_product("blhk,hkd->bld", jnp.asarray(x), quantize(jnp.asarray(w), (0, 1)))
  want = _np_int8_product(x.reshape(6, 32), w.reshape(32, 16)).reshape(2, 3, 16)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="varies over the axes"):
    int8_product("blhk,hkd->bld", jnp.asarray(x), quantize(jnp.asarray(w), (0,)))
  with pytest.raises(ValueError, match="kept axes"):
    int8_product("blhk,hkd->lbd", jnp.asarray(x), quantize(jnp.asarray(w), (0, 1)))


def test_the_uint8_form_gives_the_int8_products_bits():
  """Matrices quantized with `uint8_inputs` (their sums kept): every product form of
  model/layers.py gives the int8 × int8 product's float32 results bit for bit, alone and mapped
  over an ensemble's members (vmap of both operands, or of the input only)."""
  rng = np.random.default_rng(7)
  forms = [
    ("bld,df->blf", (6, 5, 24), (24, 10), (0,)),  # Dense
    ("bld,dhk->blhk", (6, 5, 24), (24, 4, 8), (0,)),  # W^Q, W^K, W^V
    ("blhk,hkd->bld", (2, 3, 4, 8), (4, 8, 16), (0, 1)),  # W^O
    ("bld,vd->blv", (6, 5, 24), (50, 24), (1,)),  # the output product, x Eᵀ
  ]
  for subscripts, x_shape, w_shape, axes in forms:
    x = jnp.asarray(rng.standard_normal((2, *x_shape)), jnp.float32)  # 2 members
    w = rng.standard_normal((2, *w_shape)).astype(np.float32)
    signed, unsigned = (quantize(w, tuple(a + 1 for a in axes), u) for u in (False, True))
    assert signed.sums is None and unsigned.sums.dtype == np.int32
    np.testing.assert_array_equal(
      unsigned.sums, signed.values.astype(np.int64).sum(tuple(a + 1 for a in axes), keepdims=True)
    )
    product = lambda x, m: int8_product(subscripts, x, m)
    alone = [
      jax.jit(product)(
        x[0], Int8Matrix(m.values[0], m.scale[0], None if m.sums is None else m.sums[0])
      )
      for m in (signed, unsigned)
    ]
    np.testing.assert_array_equal(np.asarray(alone[0]), np.asarray(alone[1]), err_msg=subscripts)
    both = [jax.jit(jax.vmap(product))(x, m) for m in (signed, unsigned)]
    np.testing.assert_array_equal(np.asarray(both[0]), np.asarray(both[1]), err_msg=subscripts)
    first = jax.tree_util.tree_map(lambda a: a[0], unsigned)
    inputs = jax.jit(jax.vmap(product, in_axes=(0, None)))(x, first)
    np.testing.assert_array_equal(np.asarray(inputs[0]), np.asarray(alone[1]), err_msg=subscripts)


def test_the_uint8_product_is_exact_and_checks_its_operands():
  rng = np.random.default_rng(8)
  x = rng.integers(0, 256, (3, 5, 24)).astype(np.uint8)
  w = rng.integers(-127, 128, (4, 24, 7)).astype(np.int8)
  got = uint8_int8_product(jnp.asarray(x), jnp.asarray(w), (((2,), (1,)), ((), ())))
  want = np.einsum("bld,edf->blef", x.astype(np.int64), w.astype(np.int64))
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(got), want)
  batched = uint8_int8_product(jnp.asarray(x[:1]), jnp.asarray(w[:1]), (((2,), (1,)), ((0,), (0,))))
  np.testing.assert_array_equal(np.asarray(batched)[0], want[0, :, 0])
  with pytest.raises(TypeError, match="expected uint8 x and int8 w"):
    uint8_int8_product(jnp.asarray(w), jnp.asarray(w), (((1,), (1,)), ((), ())))
  with pytest.raises(ValueError, match="pair sizes that differ"):
    uint8_int8_product(jnp.asarray(x), jnp.asarray(w), (((1,), (1,)), ((), ())))


@pytest.mark.parametrize("share_embeddings", [True, False])
def test_every_matrix_is_quantized_over_the_axes_its_product_sums(share_embeddings):
  config = dict(CONFIG, share_embeddings=share_embeddings)
  params = random_params(config)
  flat = traverse_util.flatten_dict(
    quantize_matrices(params), is_leaf=lambda p, x: isinstance(x, Int8Matrix)
  )
  scales = {"/".join(p[-2:]): x.scale.shape for p, x in flat.items() if isinstance(x, Int8Matrix)}
  kinds = {p[-1] for p, x in flat.items() if not isinstance(x, Int8Matrix)}
  assert kinds == {"bias", "scale"}, kinds
  h, d, k = 4, 32, 8
  assert scales["query/kernel"] == (1, h, k) and scales["out/kernel"] == (1, 1, d)
  assert scales["wi/kernel"] == (1, 64) and scales["wo/kernel"] == (1, d)
  assert scales["embed/embedding"] == (VOCAB, 1)
  if not share_embeddings:
    assert scales["logits/kernel"] == (1, VOCAB)
  again = quantize_matrices(quantize_matrices(params))  # already quantized: kept
  np.testing.assert_array_equal(
    again["decoder"]["layer_0"]["ffn"]["wi"]["kernel"].values,
    flat[("decoder", "layer_0", "ffn", "wi", "kernel")].values,
  )
  # An ensemble's members stacked on a leading axis: each quantized as it would be alone.
  members = [params, random_params(config, 1)]
  stacked = quantize_matrices(jax.tree_util.tree_map(lambda *a: np.stack(a), *members), leading=1)
  for i, member in enumerate(members):
    alone = jax.tree_util.tree_leaves(quantize_matrices(member))
    for got, want in zip(jax.tree_util.tree_leaves(stacked), alone, strict=True):
      np.testing.assert_array_equal(got[i], want)


@pytest.mark.parametrize("kind", ["transformer", "decoder_only"])
def test_a_model_decoding_in_int8_stays_close_to_float32(kind):
  """decode_step's logits through the int8 matrices `matrices_for_decoding` makes, against the
  float32 model: close, and the same argmax for most rows."""
  config = dict(CONFIG, type=kind)
  params = random_params(config, 3)
  f32, i8 = build_model(config), build_model(dict(config, dtype="int8"))
  quantized = decoder_state.matrices_for_decoding(i8, params)
  assert isinstance(quantized["decoder"]["layer_0"]["ffn"]["wo"]["kernel"], Int8Matrix)
  assert decoder_state.matrices_for_decoding(f32, params) is params
  inputs = jnp.asarray(np.random.default_rng(4).integers(3, VOCAB, (16, 7)), jnp.int32)
  ids = jnp.asarray(np.random.default_rng(5).integers(3, VOCAB, (16, 1)), jnp.int32)

  @jax.jit(static_argnums=0)
  def logits(model, p):
    cache = decoder_state.initial_cache(model, p, inputs, 8)
    out, _ = model.apply({"params": p, **cache}, ids, method="decode_step", mutable=True)
    return out.reshape(ids.shape[0], -1)  # [rows, vocab]

  exact, approx = np.asarray(logits(f32, params)), np.asarray(logits(i8, quantized))
  # The uint8 form: the same products, bit for bit (test_the_uint8_form_...); the float32 ops
  # around them may fuse otherwise in its program (the same bits with XLA:CPU's defaults here,
  # 4.8e-7 apart with YNNPACK off), so the step's logits are compared to within that.
  unsigned = quantize_matrices(params, uint8_inputs=True)
  np.testing.assert_allclose(np.asarray(logits(i8, unsigned)), approx, rtol=0, atol=2e-6)
  assert np.abs(approx - exact).max() < 0.06 * np.abs(exact).max()
  assert np.sqrt(np.mean((approx - exact) ** 2)) < 0.05 * np.sqrt(np.mean(exact**2))
  assert np.mean(approx.argmax(-1) == exact.argmax(-1)) >= 0.75  # random weights: near ties
  assert not np.array_equal(approx, exact)  # the int8 path ran


def test_numpy_quantizes_as_jax_does():
  """inference/restore.py quantizes restored (numpy) parameters on the host; a search quantizes
  jax arrays: the same int8 values and scales."""
  w = 0.05 * np.random.default_rng(6).standard_normal((512, 4, 256)).astype(np.float32)
  host, traced = quantize(w, (0,)), jax.jit(quantize, static_argnums=1)(jnp.asarray(w), (0,))
  assert isinstance(host.values, np.ndarray) and host.values.dtype == np.int8
  np.testing.assert_array_equal(host.values, np.asarray(traced.values))
  np.testing.assert_array_equal(host.scale, np.asarray(traced.scale))
