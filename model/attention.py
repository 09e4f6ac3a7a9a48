"""Scaled dot-product attention (a pure function).

    Attention(Q, K, V) = softmax(Q Kᵀ / √d_k) V          (paper, eq. 1)

Shapes use `heads` for h and `d_k` / `d_v` for the per-head widths (d_model / h in the paper).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from model.dropout import dropout


def _check_shapes(query, key, value, mask):
  if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
    raise ValueError(
      "dot_product_attention: query, key and value must be [batch, length, heads, depth]; got "
      f"query {query.shape}, key {key.shape}, value {value.shape}"
    )
  bq, _, hq, dq = query.shape
  bk, lk, hk, dk = key.shape
  bv, lv, hv, _ = value.shape
  if not (bq == bk == bv and hq == hk == hv and dq == dk and lk == lv):
    raise ValueError(
      "dot_product_attention: mismatched shapes: query [batch, q_len, heads, d_k] "
      f"{query.shape}, key [batch, kv_len, heads, d_k] {key.shape}, value "
      f"[batch, kv_len, heads, d_v] {value.shape}"
    )
  if mask is not None:
    full = (bq, hq, query.shape[1], lk)
    if mask.ndim != 4 or any(m not in (1, f) for m, f in zip(mask.shape, full)):
      raise ValueError(
        f"dot_product_attention: mask shape {mask.shape} does not broadcast to "
        f"[batch, heads, q_len, kv_len] = {full}"
      )


def attention_weights(query: jax.Array, key: jax.Array, mask: jax.Array | None = None) -> jax.Array:
  """softmax(Q Kᵀ / √d_k) over the keys, in float32.

  Args:
    query: [batch, q_len, heads, d_k].
    key: [batch, kv_len, heads, d_k].
    mask: boolean, broadcastable to [batch, heads, q_len, kv_len]; True = may attend.

  Returns:
    [batch, heads, q_len, kv_len] float32 weights. A query row whose keys are all masked gets
    all-zero weights (not NaN, not uniform), so its output is zero.
  """
  depth = query.shape[-1]
  query = query / jnp.sqrt(depth).astype(query.dtype)
  logits = jnp.einsum("bqhd,bkhd->bhqk", query, key, preferred_element_type=jnp.float32)
  return _masked_softmax(logits, mask)


def _masked_softmax(logits: jax.Array, mask: jax.Array | None) -> jax.Array:
  """softmax over the last axis where `mask` is True; a fully masked row gets zeros."""
  if mask is None:
    return jax.nn.softmax(logits, axis=-1)
  weights = jax.nn.softmax(jnp.where(mask, logits, jnp.finfo(jnp.float32).min), axis=-1)
  # A fully masked row would softmax to uniform weights: zero it instead.
  return jnp.where(jnp.any(mask, axis=-1, keepdims=True), weights, 0.0)


def dot_product_attention(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  mask: jax.Array | None = None,
  *,
  dropout_rate: float = 0.0,
  dropout_rng: jax.Array | None = None,
  return_weights: bool = False,
):
  """Scaled dot-product attention.

  Args:
    query: [batch, q_len, heads, d_k].
    key: [batch, kv_len, heads, d_k].
    value: [batch, kv_len, heads, d_v].
    mask: boolean, broadcastable to [batch, heads, q_len, kv_len]; True = may attend.
    dropout_rate: dropout on the attention weights (applied when `dropout_rng` is given).
    dropout_rng: PRNG key for that dropout; None = deterministic.
    return_weights: also return the [batch, heads, q_len, kv_len] weights (before dropout).

  Returns:
    [batch, q_len, heads, d_v] in the dtype of `value` (and the weights if asked).
  """
  _check_shapes(query, key, value, mask)
  weights = attention_weights(query, key, mask)
  used = weights
  if dropout_rng is not None:
    used = dropout(weights, dropout_rate, dropout_rng)
  out = jnp.einsum("bhqk,bkhd->bqhd", used.astype(value.dtype), value)
  return (out, weights) if return_weights else out


def cached_attention(query: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array | None):
  """Attention against decode caches stored heads-major.

  Args:
    query: [batch, q_len, heads, d_k].
    key: [batch, heads, kv_len, d_k].
    value: [batch, heads, kv_len, d_v].
    mask: boolean, broadcastable to [batch, heads, q_len, kv_len]; True = may attend.

  Returns:
    [batch, q_len, heads, d_v] in the dtype of `query`, and the [batch, heads, q_len, kv_len]
    float32 weights. Same result as `dot_product_attention` on the [batch, length, heads, depth]
    layout (a fully masked row gives zeros).

  Keys and values may be float32 holding values of a narrower `query` dtype (bfloat16: the
  self-attention cache, model/layers.py): the products then run in float32 on operands rounded
  to it, exactly as XLA:CPU runs products of bfloat16 operands, without converting the cache at
  every step.
  """
  if (
    query.ndim != 4
    or key.ndim != 4
    or value.ndim != 4
    or key.shape[:3] != value.shape[:3]
    or query.shape[0] != key.shape[0]
    or query.shape[2] != key.shape[1]
    or query.shape[3] != key.shape[3]
  ):
    raise ValueError(
      "cached_attention: expected query [batch, q_len, heads, d_k], key [batch, heads, kv_len, "
      f"d_k], value [batch, heads, kv_len, d_v]; got {query.shape}, {key.shape}, {value.shape}"
    )
  dtype = query.dtype
  query = query / jnp.sqrt(query.shape[-1]).astype(dtype)
  logits = jnp.einsum(
    "bqhd,bhkd->bhqk", _rounded(query, key.dtype), key, preferred_element_type=jnp.float32
  )
  weights = _masked_softmax(logits, mask)
  # Heads-major product, then the (small) transpose: asked for [b, q, h, d] directly, XLA:CPU
  # ran the beams-as-queries cross-attention of beam search as a slow generic loop (and a
  # multiply-and-sum formulation was slower still).
  used = _rounded(weights.astype(dtype), value.dtype)
  out = jnp.einsum("bhqk,bhkd->bhqd", used, value).astype(dtype).transpose(0, 2, 1, 3)
  return out, weights


def _rounded(x: jax.Array, dtype) -> jax.Array:
  """`x` as an operand of a product with one of `dtype`: unchanged unless it is the narrower
  float (bfloat16 beside a float32 cache), then widened with its values kept exactly by
  `lax.reduce_precision`: XLA may drop a round trip through the narrower float (`astype`)."""
  info = jnp.finfo(x.dtype)
  if info.bits >= jnp.finfo(dtype).bits:
    return x
  return jax.lax.reduce_precision(
    x.astype(dtype), exponent_bits=info.nexp, mantissa_bits=info.nmant
  )
