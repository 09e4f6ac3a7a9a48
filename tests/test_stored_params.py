"""model/stored_params.py: parameters created as Flax creates them, read back without tracing
their initializers, and checked against the shape asked for."""

import flax.errors
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.linen import initializers

from model.stored_params import LayerNorm, StoredParams

CALLS = []  # one entry each time the kernel's initializer runs (or is traced)


def counted(key, shape, dtype=jnp.float32):
  CALLS.append(shape)
  return initializers.xavier_uniform()(key, shape, dtype)


def layer(base, norm):
  class Layer(base):
    @nn.compact
    def __call__(self, x):
      init = nn.with_logical_partitioning(counted, ("embed", "mlp"))
      kernel = self.param("kernel", init, (x.shape[-1], 3), jnp.float32)
      bias = self.param("bias", initializers.zeros, (3,), jnp.float32)
      return norm(name="norm")(x @ kernel + bias)

  return Layer()


STORED, FLAX = layer(StoredParams, LayerNorm), layer(nn.Module, nn.LayerNorm)
X = jnp.arange(8.0).reshape(2, 4)


def test_created_and_applied_as_flax_does():
  ours, theirs = STORED.init(jax.random.key(3), X), FLAX.init(jax.random.key(3), X)
  assert isinstance(ours["params"]["kernel"], nn.LogicallyPartitioned)  # boxed as Flax boxes
  ours, theirs = nn.meta.unbox(ours), nn.meta.unbox(theirs)
  assert jax.tree_util.tree_structure(ours) == jax.tree_util.tree_structure(theirs)
  for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs)):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(STORED.apply(ours, X), FLAX.apply(ours, X))


def test_apply_traces_no_initializer():
  params = FLAX.init(jax.random.key(0), X)
  CALLS.clear()
  jax.jit(FLAX.apply)(params, X)
  assert CALLS == [(4, 3)]  # Flax traces it to check the stored kernel's shape
  CALLS.clear()
  jax.jit(STORED.apply)(params, X)
  assert CALLS == []


@pytest.mark.parametrize("name, shape", [("kernel", (4, 5)), ("bias", (2,))])
def test_a_stored_parameter_of_another_shape_is_refused(name, shape):
  params = nn.meta.unbox(STORED.init(jax.random.key(0), X))
  params["params"][name] = jnp.zeros(shape)
  with pytest.raises(flax.errors.ScopeParamShapeError, match=f'"{name}"'):
    STORED.apply(params, X)
  params["params"].pop(name)
  with pytest.raises(flax.errors.ScopeParamNotFoundError):
    STORED.apply(params, X)
