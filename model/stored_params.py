"""Parameters read back as stored: no initializer traced for each one at every `apply`.

Flax's `Module.param` checks a stored parameter's shape against its initializer's output by
tracing the initializer (`jax.eval_shape`) every time a module reads it: a decoding program's
`apply` calls read each parameter once more, and the traces took about a fifth of tracing the
searches (docs/experiments.md). A module built on `StoredParams` reads a stored parameter through
`Module.variable` instead (Flax's `param` still creates it, at `init`) and checks its shape
against the shape asked for (the initializer's first argument after the key, as every `param`
call here and in `nn.LayerNorm` passes it), with Flax's error. What is created, stored and
computed is unchanged: the programs lower to the same text.

    class Dense(StoredParams):
      @nn.compact
      def __call__(self, x):
        kernel = self.param("kernel", init, (x.shape[-1], self.features), jnp.float32)
"""

from __future__ import annotations

import flax.errors
import flax.linen as nn
import jax
import numpy as np


class StoredParams(nn.Module):
  """A linen module whose `param` reads a stored parameter without tracing its initializer."""

  @nn.nowrap
  def param(self, name, init_fn, *init_args, unbox=True, **init_kwargs):
    """`nn.Module.param`: the parameter `name` of the `params` collection, which Flax creates
    with `init_fn(key, *init_args, **init_kwargs)` when the collection lacks it (or refuses, as
    ever); a stored one is read as it is, and one whose shape is not `init_args[0]` (when that
    is a shape) raises `flax.errors.ScopeParamShapeError` (for a stored tree in place of an
    array, such as a folded output table or an int8 matrix, its first leaf's shape, as Flax
    compares them)."""
    if not self.has_variable("params", name):  # created (or refused) by Flax itself
      return super().param(name, init_fn, *init_args, unbox=unbox, **init_kwargs)
    value = self.variable("params", name, unbox=unbox).value
    wanted = init_args[0] if init_args else None
    if isinstance(wanted, tuple | list):
      first = jax.tree_util.tree_leaves(nn.meta.unbox(value))[:1]  # of a folded or int8 tree too
      if first and np.shape(first[0]) != tuple(wanted):
        path = "/" + "/".join(self.path)
        raise flax.errors.ScopeParamShapeError(name, path, np.shape(first[0]), tuple(wanted))
    return value


class LayerNorm(StoredParams, nn.LayerNorm):
  """`nn.LayerNorm` (the same parameters and arithmetic), its scale and bias read as stored."""
