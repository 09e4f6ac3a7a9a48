"""uint8 × int8 products summed in int32: the form of integer product that VNNI multiplies.

x86's VNNI instruction (`vpdpbusd`: AVX512-VNNI, AVX-VNNI) multiplies unsigned by signed bytes,
and XLA:CPU's library kernels (YNNPACK) run a uint8 × int8 -> int32 `dot` on it; an int8 × int8
one they widen to 16 bits first, no faster than float32 on such a CPU (docs/experiments.md).
`jax.lax.dot_general` promotes a uint8 × int8 pair to int32 × int32 (slower still), so this
module emits the mixed `dot` itself, as a primitive whose lowering is StableHLO's `dot_general`.

    total = uint8_int8_product(x_u8, w_s8, ((x_summed, w_summed), (x_batch, w_batch)))

The result is exact (integer sums), laid out as `dot_general`'s: batch axes, then x's other axes,
then w's. For the int8 × int8 product of `x` (values in -127..127) shift x by 128 and subtract
128 × w's sums over the same axes (model/quantize.py): the same int32 values, bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.extend.mlir.dialects import stablehlo
from jax.interpreters import batching, mlir

Axes = tuple[int, ...]
Dims = tuple[tuple[Axes, Axes], tuple[Axes, Axes]]  # ((x summed, w summed), (x batch, w batch))

_product = Primitive("uint8_int8_product")


def uint8_int8_product(x: jax.Array, w: jax.Array, dims: Dims) -> jax.Array:
  """x (uint8) times w (int8) summed over `dims[0]`'s axes (paired in order), batched over
  `dims[1]`'s: int32 [*batch axes, *x's other axes, *w's other axes]."""
  if x.dtype != jnp.uint8 or w.dtype != jnp.int8:
    raise TypeError(f"uint8_int8_product: expected uint8 x and int8 w, got {x.dtype} and {w.dtype}")
  (xs, ws), (xb, wb) = dims
  if [x.shape[a] for a in (*xs, *xb)] != [w.shape[a] for a in (*ws, *wb)]:
    raise ValueError(
      f"uint8_int8_product: axes {dims} pair sizes that differ: x {x.shape}, w {w.shape}"
    )
  dims = tuple(tuple(tuple(int(a) for a in axes) for axes in pair) for pair in dims)
  return _product.bind(x, w, numbers=dims)


def _kept(ndim: int, *used: Axes) -> list[int]:
  return [a for a in range(ndim) if not any(a in axes for axes in used)]


def _shape(x, w, dims: Dims):
  (xs, ws), (xb, wb) = dims
  return (
    *(x.shape[a] for a in xb),
    *(x.shape[a] for a in _kept(x.ndim, xs, xb)),
    *(w.shape[a] for a in _kept(w.ndim, ws, wb)),
  )


def _abstract_eval(x, w, *, numbers: Dims):
  return jax.core.ShapedArray(_shape(x, w, numbers), jnp.int32)


def _lowering(ctx, x, w, *, numbers: Dims):
  (xs, ws), (xb, wb) = numbers
  dot = stablehlo.DotDimensionNumbers.get(
    lhs_batching_dimensions=list(xb),
    rhs_batching_dimensions=list(wb),
    lhs_contracting_dimensions=list(xs),
    rhs_contracting_dimensions=list(ws),
  )
  (out,) = ctx.avals_out
  return [stablehlo.dot_general(mlir.aval_to_ir_type(ctx.module_context, out), x, w, dot)]


def _batched(args, axes, *, numbers: Dims):
  """vmap (an ensemble's members): the mapped axis moved to the front of each operand mapped;
  a batch axis of the product when both are, else a kept axis of the one that is."""
  (x, w), (ax, aw) = args, axes
  (xs, ws), (xb, wb) = numbers
  up = lambda axes: tuple(a + 1 for a in axes)
  if ax is not None:
    x, xs, xb = jnp.moveaxis(x, ax, 0), up(xs), up(xb)
  if aw is not None:
    w, ws, wb = jnp.moveaxis(w, aw, 0), up(ws), up(wb)
  if ax is not None and aw is not None:
    return _product.bind(x, w, numbers=((xs, ws), ((0, *xb), (0, *wb)))), 0
  out = _product.bind(x, w, numbers=((xs, ws), (xb, wb)))
  if ax is not None:
    return out, len(xb)  # x's first kept axis
  return out, len(xb) + len(_kept(x.ndim, xs, xb))  # w's first kept axis


_product.def_abstract_eval(_abstract_eval)


@jax.jit(static_argnames="dims")
def _compiled(x, w, dims: Dims):  # the product outside a traced function: compiled on its own
  return _product.bind(x, w, numbers=dims)


_product.def_impl(lambda x, w, *, numbers: _compiled(x, w, numbers))
mlir.register_lowering(_product, _lowering)
batching.primitive_batchers[_product] = _batched
