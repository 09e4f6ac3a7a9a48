"""Attention masks (pure functions). All masks are boolean, True = may attend, and shaped
[batch, 1, q_len, kv_len] so they broadcast over heads.

Token arrays use id 0 for padding. Segment ids number the sentences packed into one row
(1, 2, ...; 0 on padding): a token may only attend within its own segment.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _check_2d(name: str, x: jax.Array):
  if x.ndim != 2:
    raise ValueError(f"{name} must be [batch, length], got shape {x.shape}")


def padding_mask(query_tokens: jax.Array, key_tokens: jax.Array) -> jax.Array:
  """[batch, q_len], [batch, kv_len] token ids -> [batch, 1, q_len, kv_len]: both non-padding."""
  _check_2d("padding_mask: query_tokens", query_tokens)
  _check_2d("padding_mask: key_tokens", key_tokens)
  if query_tokens.shape[0] != key_tokens.shape[0]:
    raise ValueError(
      f"padding_mask: batch sizes differ: query_tokens {query_tokens.shape}, "
      f"key_tokens {key_tokens.shape}"
    )
  return (query_tokens > 0)[:, None, :, None] & (key_tokens > 0)[:, None, None, :]


def causal_mask(length: int) -> jax.Array:
  """[1, 1, length, length]: position i may attend to positions j <= i (no look-ahead)."""
  return jnp.tril(jnp.ones((length, length), dtype=jnp.bool_))[None, None]


def segment_mask(query_segments: jax.Array, key_segments: jax.Array) -> jax.Array:
  """[batch, q_len], [batch, kv_len] segment ids -> [batch, 1, q_len, kv_len]: same segment."""
  _check_2d("segment_mask: query_segments", query_segments)
  _check_2d("segment_mask: key_segments", key_segments)
  if query_segments.shape[0] != key_segments.shape[0]:
    raise ValueError(
      f"segment_mask: batch sizes differ: query_segments {query_segments.shape}, "
      f"key_segments {key_segments.shape}"
    )
  return query_segments[:, None, :, None] == key_segments[:, None, None, :]


def combine_masks(*masks: jax.Array | None) -> jax.Array | None:
  """Logical AND of the given masks (None entries are ignored; all None -> None)."""
  masks = [m for m in masks if m is not None]
  if not masks:
    return None
  out = masks[0]
  for m in masks[1:]:
    out = jnp.logical_and(out, m)
  return out


def encoder_self_mask(inputs: jax.Array, inputs_segmentation: jax.Array | None = None) -> jax.Array:
  """Encoder self-attention: non-padding tokens of the same segment."""
  seg = (
    None if inputs_segmentation is None else segment_mask(inputs_segmentation, inputs_segmentation)
  )
  return combine_masks(padding_mask(inputs, inputs), seg)


def decoder_self_mask(
  targets: jax.Array, targets_segmentation: jax.Array | None = None
) -> jax.Array:
  """Decoder self-attention: non-padding, same segment, and no look-ahead.

  `targets` are the decoder's *output* positions (the unshifted targets), so position t (which
  predicts token t) is valid exactly where token t is.
  """
  seg = (
    None
    if targets_segmentation is None
    else segment_mask(targets_segmentation, targets_segmentation)
  )
  return combine_masks(padding_mask(targets, targets), causal_mask(targets.shape[1]), seg)


def cross_mask(
  targets: jax.Array,
  inputs: jax.Array,
  targets_segmentation: jax.Array | None = None,
  inputs_segmentation: jax.Array | None = None,
) -> jax.Array:
  """Encoder-decoder attention: target positions attend to source tokens of the same segment."""
  if (targets_segmentation is None) != (inputs_segmentation is None):
    raise ValueError(
      "cross_mask: give both targets_segmentation and inputs_segmentation, or neither"
    )
  seg = (
    None
    if targets_segmentation is None
    else segment_mask(targets_segmentation, inputs_segmentation)
  )
  return combine_masks(padding_mask(targets, inputs), seg)
