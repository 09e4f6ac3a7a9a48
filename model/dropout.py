"""Dropout (Srivastava et al. 2014; the paper's section 5.4), with masks from a keyed hash.

`jax.random.bernoulli` draws each mask element with threefry-2x32 (20 rounds of 32-bit mixing per
pair of elements), a sizeable part of the base model's step on a CPU. Here one PRNG key gives two
32-bit words per call, and each element's mask bit is a hash of its flat index and those words: a
multiply by the golden ratio, then two rounds of MurmurHash3's 32-bit finaliser, far cheaper
(docs/experiments.md, "Step time", has the measurement). Like threefry's, the mask is a pure
function of (key, shape): reproducible, different for every key, and identical under any sharding of
the array, since the index is the global one. The keep probability is exact to 2^-32. The hash is
not cryptographic, which dropout does not need. Arrays of 2^32 elements or more fall back to
`jax.random.bernoulli`.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

_GOLDEN = 0x9E3779B9  # odd, so index -> index * _GOLDEN is a bijection modulo 2^32


def _fmix32(h: jax.Array) -> jax.Array:
  """MurmurHash3's finaliser: a bijection of uint32 in which every input bit moves every output
  bit."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _flat_index(shape: tuple[int, ...]) -> jax.Array:
  """uint32 [*shape] holding each element's row-major index (built from per-axis iotas, which a
  sharded computation splits without materialising the whole range)."""
  index = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(len(shape))):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride)
    stride *= shape[axis]
  return index


def keep_mask(key: jax.Array, rate: float, shape: tuple[int, ...]) -> jax.Array:
  """Boolean [*shape], each element True with probability 1 - rate, independently across
  elements and keys."""
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"dropout: rate must be in [0, 1), got {rate}")
  shape = tuple(int(d) for d in shape)
  if int(np.prod(shape, dtype=np.int64)) >= 2**32:
    return jax.random.bernoulli(key, 1.0 - rate, shape)
  words = jax.random.bits(key, (2,), jnp.uint32)
  h = _fmix32(_flat_index(shape) * jnp.uint32(_GOLDEN) + words[0])
  h = _fmix32(h ^ words[1])
  return h >= jnp.uint32(min(round(rate * 2**32), 2**32 - 1))


def dropout(x: jax.Array, rate: float, key: jax.Array) -> jax.Array:
  """x with each element zeroed with probability `rate` and the rest scaled by 1 / (1 - rate),
  so the expectation is unchanged. Same shape and dtype as x."""
  if rate == 0.0:
    return x
  keep = keep_mask(key, rate, x.shape)
  return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


class Dropout(nn.Module):
  """`dropout` with the module's "dropout" PRNG stream, as `flax.linen.Dropout` is used:
  `Dropout(rate)(x, deterministic=...)`; deterministic (or rate 0) returns x."""

  rate: float

  @nn.compact
  def __call__(self, x: jax.Array, deterministic: bool) -> jax.Array:
    if deterministic or self.rate == 0.0:
      return x
    return dropout(x, self.rate, self.make_rng("dropout"))
