"""int8 products for decoding, as CTranslate2's int8 computes them: every parameter matrix
quantized once, symmetric per output channel (scale = max |w| / 127 over the axes a product sums
over); each product's input quantized per row as it comes (scale = max |x| / 127 over the same
axes); the int8 × int8 product summed in int32, then scaled back to float32. Everything between
products (attention, softmax, LayerNorm, residuals) stays float32.

    params = quantize_matrices(params)       # `kernel` / `embedding` leaves -> Int8Matrix
    y = int8_product("bld,vd->blv", x, params["embed"]["embedding"])   # [b, l, v] float32

XLA:CPU runs the int8 × int8 -> int32 product as a library kernel (YNNPACK: AMX where the CPU
has it; docs/experiments.md measures it per CPU kind). Where the CPU multiplies bytes with VNNI
(unsigned by signed) and has no AMX, matrices quantized with `uint8_inputs=True` carry their
sums over the summed axes, and the product takes its input shifted to uint8 (+128) and subtracts
128 × those sums (model/uint8_product.py): the same int32 sums, bit for bit.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

LEVELS = 127  # symmetric: -127..127, so that a sign flip never overflows
MATRICES = ("kernel", "embedding")  # the parameters that model/layers.py's products read


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8Matrix:
  """A quantized matrix: `values` int8 in the matrix's own shape; `scale` float32 in the same
  shape with the summed axes of size 1, so that `values * scale` is the matrix again (to within
  half a step per entry); `sums`, where products take their input as uint8, the int32 sums of
  `values` over the summed axes (shaped as `scale`), else None."""

  values: jax.Array
  scale: jax.Array
  sums: jax.Array | None = None


def _rounded(x, axes: tuple[int, ...]):
  """(x / scale rounded to integers in -127..127, as float32; scale), one scale per slice over
  `axes` (max |x| there / 127; an all-zero slice gets scale 1). numpy for a numpy `x`."""
  xp = np if isinstance(x, np.ndarray) else jnp
  x = x.astype(np.float32)
  # Multiplications by reciprocals: XLA rewrites divisions so, numpy does not (same results).
  scale = xp.max(xp.abs(x), axis=axes, keepdims=True) * np.float32(1 / LEVELS)
  scale = xp.where(scale > 0, scale, np.float32(1))
  inverse = np.float32(1) / scale  # x times it, as XLA computes x / scale
  return xp.clip(xp.round(x * inverse), -LEVELS, LEVELS), scale


def quantize(x, axes: tuple[int, ...], uint8_inputs: bool = False) -> Int8Matrix:
  """`x` as int8 with one scale per slice over `axes` (max |x| there / 127; an all-zero slice
  gets scale 1), and the values' sums over `axes` if `uint8_inputs` (`Int8Matrix.sums`). A numpy
  `x` is quantized by numpy (on the host, nothing compiled), to the same values as jax gives."""
  rounded, scale = _rounded(x, axes)
  values = rounded.astype(np.int8)
  sums = values.sum(axis=axes, keepdims=True, dtype=np.int32) if uint8_inputs else None
  return Int8Matrix(values, scale, sums)


def dequantize(m: Int8Matrix) -> jax.Array:
  """The float32 matrix `m` stands for."""
  return m.values.astype(jnp.float32) * m.scale


def take_rows(m: Int8Matrix, ids: jax.Array) -> jax.Array:
  """Rows `ids` of a [rows, d] matrix quantized per row (an embedding): [*ids.shape, d] float32."""
  return dequantize(Int8Matrix(jnp.take(m.values, ids, axis=0), jnp.take(m.scale, ids, axis=0)))


def int8_product(subscripts: str, x: jax.Array, w: Int8Matrix, out_dtype=jnp.float32):
  """`jnp.einsum(subscripts, x, w)` with `x` quantized per row over the summed axes and an int32
  sum, scaled back and returned in `out_dtype`. The output's letters must be x's kept letters then
  w's (as every product of model/layers.py is written), every summed letter in both, and `w`
  quantized over the axes summed here. With `w.sums` the int32 sums come from the uint8 form of
  x's values (the same numbers)."""
  inputs, out = subscripts.split("->")
  xs, ws = inputs.split(",")
  x_kept = "".join(c for c in xs if c in out)
  w_kept = "".join(c for c in ws if c in out)
  summed = [c for c in xs if c not in out]
  if out != x_kept + w_kept or "." in subscripts or sorted(summed) != sorted(set(ws) - set(out)):
    raise ValueError(
      f"int8_product: {subscripts!r} must write x's kept axes, then w's, and sum axes of both"
    )
  x_summed = tuple(xs.index(c) for c in summed)
  w_summed = tuple(ws.index(c) for c in summed)
  if any(w.scale.shape[i] != 1 for i in w_summed):
    raise ValueError(
      f"int8_product: the matrix's scale {w.scale.shape} varies over the axes {subscripts!r} "
      "sums; quantize it over them"
    )
  rounded, scale = _rounded(x, x_summed)
  if w.sums is None:
    values = rounded.astype(jnp.int8)
    total = jnp.einsum(subscripts, values, w.values, preferred_element_type=jnp.int32)
  else:  # (x + 128) w - 128 sum(w): the int8 product's int32 values, exactly
    # +128 before the one conversion (exact: integers in 1..255); XLA:CPU's float -> int8 ->
    # int32 -> uint8 chain does not vectorize, one float -> uint8 conversion does.
    shifted = (rounded + 128).astype(jnp.uint8)
    # Imported where first traced: it needs jax.extend, whose import a process that traces no
    # uint8 product (float32, programs read back) need not pay (docs/experiments.md).
    from model.uint8_product import uint8_int8_product

    total = uint8_int8_product(shifted, w.values, ((x_summed, w_summed), ((), ())))
    total = total - 128 * jnp.squeeze(w.sums, w_summed)
  x_scale = jnp.squeeze(scale, x_summed).reshape(
    tuple(x.shape[i] for i, c in enumerate(xs) if c in out) + (1,) * len(w_kept)
  )
  w_scale = jnp.squeeze(w.scale, w_summed)
  return (total.astype(jnp.float32) * x_scale * w_scale).astype(out_dtype)


# The axes each parameter matrix's products sum over, by the layouts of model/layers.py: a kernel
# sums its first axis (Dense [d_in, d_out]; W^Q, W^K, W^V [d_model, heads, d_k]), W^O [heads, d_k,
# d_model] its first two; the embedding [vocab, d_model] is read by rows and multiplied as x Eᵀ,
# summing d_model.
_SUMMED_BY_MODULE = {"out": (0, 1)}


def quantize_matrices(params, leading: int = 0, uint8_inputs: bool = False):
  """`params` with each `kernel` and `embedding` leaf an `Int8Matrix` (leaves already quantized
  stay as they are); biases and LayerNorm parameters stay float32. `leading`: axes in front of
  every leaf (1 for an ensemble's stacked members), which no scale spans; `uint8_inputs`: products
  take their inputs as uint8 (`quantize`; core/cpu.py's `uint8_int8_products` says where)."""

  def leaf(path, x):
    names = [getattr(k, "key", None) for k in path]
    if isinstance(x, Int8Matrix) or names[-1] not in MATRICES:
      return x
    if names[-1] == "embedding":
      axes = (x.ndim - 1,)
    else:
      parent = names[-2] if len(names) > 1 else None
      axes = tuple(leading + a for a in _SUMMED_BY_MODULE.get(parent, (0,)))
    return quantize(x, axes, uint8_inputs)

  return jax.tree_util.tree_map_with_path(leaf, params, is_leaf=lambda v: isinstance(v, Int8Matrix))
