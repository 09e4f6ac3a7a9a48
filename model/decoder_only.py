"""A decoder-only Transformer language model over `source <sep> target`, with the encoder-decoder's
interface (see model/build.py).

    logits = DecoderOnly(cfg).apply({'params': p}, inputs, targets)   # [batch, tgt_len, vocab]

Layout of one sentence pair (source ids ending in EOS, targets ending in EOS):

    tokens     x_1 .. x_n(EOS)  SEP  y_1 .. y_{m-1}
    positions  0   .. n-1       n    n+1 .. n+m-1
    predicts   (ignored)        y_1  y_2 .. y_m(EOS)

The source keeps its EOS; the target part is `shift_right(targets)` with the start symbol 0
replaced by SEP, so the logits at the target part line up with `targets` and are the only ones
computed (the source positions' hidden states are never projected to the vocabulary; the loss on
targets never sees them). The combined row is simply `[inputs row ; target part row]` (no tokens
are moved): attention is causal by the positions above, within a segment (packed rows), and never
reads padding, wherever it is.

Decoding: `init_cache` feeds each sentence's source tokens one by one into the key/value caches
of the causal stack (prefill, `lax.scan`), each row with its own cache index (the stack is
`vmap`ped over rows, so sources of different lengths leave no padding in the caches).
`decode_step` reads id 0 (the start symbol, first step) as SEP and continues from there, so the
first step predicts y_1 from `... x_n SEP`, as in teacher forcing.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from model import cache_kinds
from model.config import TransformerConfig
from model.dropout import Dropout
from model.layers import (
  DecoderLayer,
  Dense,
  Embed,
  layer_norm,
  maybe_remat,
  sinusoidal_encoding,
)
from model.special_tokens import SEP_ID
from model.transformer import check_tokens, shift_right


class CausalStack(nn.Module):
  """Embedding + sinusoidal positions, dropout, N decoder layers without cross-attention,
  (final LayerNorm,) output projection."""

  config: TransformerConfig

  @nn.compact
  def __call__(
    self, tokens, positions, mask, deterministic, decode=False, project=True, project_from=0
  ):
    """tokens, positions: [batch, length]; mask: [batch, 1, length, length] (None when decoding
    one position from the cache). Returns [batch, length - project_from, vocab] logits of the
    positions from `project_from` on (`project`; the others are never projected), or the final
    hidden states [batch, length, d_model]."""
    cfg = self.config
    embed = Embed(cfg.vocab_size, cfg.d_model, cfg.compute_dtype, name="embed")
    y = embed(tokens) + sinusoidal_encoding(positions, cfg.d_model).astype(cfg.compute_dtype)
    y = Dropout(cfg.dropout_rate)(y, deterministic=deterministic)
    layer = maybe_remat(DecoderLayer, cfg, static_argnums=(5, 6, 7))
    for i in range(cfg.num_layers):
      y = layer(cfg, cross_attention=False, name=f"layer_{i}")(
        y, None, mask, None, deterministic, decode, False
      )
    if cfg.pre_ln:
      y = layer_norm("final_norm", cfg)(y)
    if not project:
      return y
    y = y[:, project_from:]
    if cfg.share_embeddings:
      return embed.attend(y)
    return Dense(cfg.vocab_size, ("embed", "vocab"), cfg.compute_dtype, name="logits")(y)


def _default_positions(valid, seg):
  """Position of each token among the real tokens of its segment: [batch, length]."""
  length = valid.shape[1]
  before = jnp.tril(jnp.ones((length, length), bool), -1)  # [query, key]: key strictly before
  same = (seg[:, :, None] == seg[:, None, :]) & valid[:, None, :] & before[None]
  return jnp.sum(same, axis=-1, dtype=jnp.int32)


def combined_sequence(
  inputs,
  targets,
  inputs_position=None,
  targets_position=None,
  inputs_segmentation=None,
  targets_segmentation=None,
):
  """The model's input row `[source ; SEP + shifted target]` and its attention mask.

  inputs: [batch, src_len], targets: [batch, tgt_len] ids (0 = pad), optional positions and
  segment ids. Returns tokens and positions [batch, src_len + tgt_len] and the boolean mask
  [batch, 1, src_len + tgt_len, src_len + tgt_len] (True = may attend).
  """
  if (inputs_segmentation is None) != (targets_segmentation is None):
    raise ValueError(
      "DecoderOnly: give both inputs_segmentation and targets_segmentation, or neither"
    )
  src_valid, tgt_valid = inputs > 0, targets > 0
  if inputs_segmentation is None:
    src_seg, tgt_seg = src_valid.astype(jnp.int32), tgt_valid.astype(jnp.int32)
  else:
    src_seg = inputs_segmentation.astype(jnp.int32)
    tgt_seg = targets_segmentation.astype(jnp.int32)
  src_pos = (
    _default_positions(src_valid, src_seg)
    if inputs_position is None
    else inputs_position.astype(jnp.int32)
  )
  tgt_pos = (
    _default_positions(tgt_valid, tgt_seg)
    if targets_position is None
    else targets_position.astype(jnp.int32)
  )
  # Each target position is offset by its sentence's source length (the source and SEP come first).
  src_len = jnp.sum(
    (tgt_seg[:, :, None] == src_seg[:, None, :]) & src_valid[:, None, :], axis=-1, dtype=jnp.int32
  )
  shifted = shift_right(targets, targets_segmentation)
  shifted = jnp.where(tgt_valid & (shifted == 0), SEP_ID, shifted)
  tokens = jnp.concatenate([inputs, shifted], axis=1)
  positions = jnp.concatenate([src_pos, src_len + tgt_pos], axis=1)
  seg = jnp.concatenate([src_seg, tgt_seg], axis=1)
  valid = jnp.concatenate([src_valid, tgt_valid], axis=1)
  mask = (
    valid[:, :, None]
    & valid[:, None, :]
    & (seg[:, :, None] == seg[:, None, :])
    & (positions[:, None, :] <= positions[:, :, None])
  )
  return tokens, positions, mask[:, None]


class DecoderOnly(nn.Module):
  """Causal Transformer LM translating by continuing `source <sep>` (see the module doc)."""

  config: TransformerConfig

  def setup(self):
    self.decoder = CausalStack(self.config)

  def encode(self, inputs, inputs_position=None, inputs_segmentation=None, deterministic=True):
    """No encoder: returns the source ids [batch, src_len] (read again by `init_cache`)."""
    del inputs_position, inputs_segmentation, deterministic
    check_tokens("DecoderOnly", "inputs", inputs)
    return inputs

  def __call__(
    self,
    inputs,
    targets,
    inputs_position=None,
    targets_position=None,
    inputs_segmentation=None,
    targets_segmentation=None,
    deterministic=True,
  ):
    """[batch, src_len], [batch, tgt_len] ids -> [batch, tgt_len, vocab] logits (target part)."""
    check_tokens("DecoderOnly", "inputs", inputs)
    check_tokens("DecoderOnly", "targets", targets)
    if targets.shape[0] != inputs.shape[0]:
      raise ValueError(
        f"DecoderOnly: batch sizes differ: inputs {inputs.shape}, targets {targets.shape}"
      )
    for name, arr, like, like_name in (
      ("inputs_position", inputs_position, inputs, "inputs"),
      ("inputs_segmentation", inputs_segmentation, inputs, "inputs"),
      ("targets_position", targets_position, targets, "targets"),
      ("targets_segmentation", targets_segmentation, targets, "targets"),
    ):
      if arr is not None:
        check_tokens("DecoderOnly", like_name, like, arr, name)
    tokens, positions, mask = combined_sequence(
      inputs, targets, inputs_position, targets_position, inputs_segmentation, targets_segmentation
    )
    # The target part is the last tgt_len columns of every row (packed rows too): only its
    # positions are projected to the vocabulary.
    return self.decoder(tokens, positions, mask, deterministic, project_from=inputs.shape[1])

  def _row_fn(self, project: bool):
    """A pure per-row decode step `(params, cache, ids [1, 1], positions [1, 1]) -> (out, cache)`
    of an unbound copy of the stack (the XLA attention path; one query needs no fused kernel)."""
    stack = CausalStack(dataclasses.replace(self.config, attention_impl="xla"), parent=None)

    def row(params, rows, ids, positions):
      out, state = stack.apply(
        {"params": params, **rows},
        ids,
        positions,
        None,
        True,
        decode=True,
        project=project,
        mutable=cache_kinds.CARRIED,
      )
      return out, dict(state)

    return row

  def init_cache(self, encoded, inputs, max_decode_len: int):
    """Creates the decoding cache (call with `mutable=model.cache_kinds.COLLECTIONS`) and runs every
    row's source through it: per row, the stack's key/value buffers of `src_len + max_decode_len`
    positions (`TARGET` "rows", leaves [batch, 1, ...]), its cache indices [batch] and the next
    position [batch] (`STATE` "rows" and "position").

    encoded: the source ids from `encode`; inputs: [batch, src_len] ids (0 = pad, anywhere).
    """
    del encoded
    check_tokens("DecoderOnly", "inputs", inputs)
    batch, src_len = inputs.shape
    params = self.decoder.variables["params"]
    # Real tokens first, padding after, in each row; then feed position by position.
    order = jnp.argsort(inputs == 0, axis=1, stable=True)
    source = jnp.take_along_axis(inputs, order, axis=1)
    lengths = jnp.sum(inputs > 0, axis=1, dtype=jnp.int32)
    dummy = jnp.ones((1, src_len + max_decode_len), jnp.int32)
    make = lambda: CausalStack(
      dataclasses.replace(self.config, attention_impl="xla"), parent=None
    ).apply(
      {"params": params},
      dummy,
      dummy,
      None,
      True,
      decode=True,
      project=False,
      mutable=cache_kinds.CARRIED,
    )
    shapes = dict(jax.eval_shape(make)[1])
    cache_kinds.check_collections(shapes, "DecoderOnly")
    rows = jax.tree_util.tree_map(lambda s: jnp.zeros((batch,) + s.shape, s.dtype), shapes)
    row = jax.vmap(self._row_fn(project=False), in_axes=(None, 0, 0, 0))

    def feed(rows, xs):
      token, position = xs
      _, rows = row(params, rows, token[:, None, None], jnp.broadcast_to(position, (batch, 1, 1)))
      return rows, None

    rows, _ = lax.scan(feed, rows, (source.T, jnp.arange(src_len, dtype=jnp.int32)))
    # Padding fed after a row's source is forgotten: its cache indices (the stack's only `STATE`
    # entries) go back to the source length (later slots are masked and overwritten).
    self.put_variable(
      cache_kinds.STATE, "rows", jax.tree_util.tree_map(lambda _: lengths, rows[cache_kinds.STATE])
    )
    self.put_variable(cache_kinds.TARGET, "rows", rows[cache_kinds.TARGET])
    self.put_variable(cache_kinds.STATE, "position", lengths)

  def decode_step(self, ids):
    """One decoding step from the cache (call with `mutable=model.cache_kinds.CARRIED`).

    ids: [batch, 1], the previous target token; 0 (the start symbol) is read as SEP.
    Returns [batch, vocab].
    """
    if ids.ndim != 2 or ids.shape[1] != 1:
      raise ValueError(f"DecoderOnly.decode_step: ids must be [batch, 1], got {ids.shape}")
    ids = jnp.where(ids == 0, SEP_ID, ids)
    position = self.get_variable(cache_kinds.STATE, "position")
    row = jax.vmap(self._row_fn(project=True), in_axes=(None, 0, 0, 0))
    logits, rows = row(
      self.decoder.variables["params"],
      {kind: self.get_variable(kind, "rows") for kind in cache_kinds.CARRIED},
      ids[:, :, None],
      position[:, None, None],
    )
    for kind in cache_kinds.CARRIED:
      self.put_variable(kind, "rows", rows[kind])
    self.put_variable(cache_kinds.STATE, "position", position + 1)
    return logits[:, 0, 0]
