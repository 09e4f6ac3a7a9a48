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

The stack is model/transformer.py's `Decoder` without cross-attention (`cross_attention=False`,
its own embedding): the same layers, parameters and incremental decoding as the
encoder-decoder's.

Decoding: `init_cache` runs every sentence's source through the stack's key/value caches in one
call (the prompt: its real tokens first, so sources of different lengths leave no gaps), then
sets each row's cache indices to its own source length (padding written after the source is
never attended to and is overwritten). `decode_step` reads id 0 (the start symbol, first step)
as SEP and continues from there, so the first step predicts y_1 from `... x_n SEP`, as in
teacher forcing.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from model import cache_kinds
from model.config import TransformerConfig
from model.special_tokens import SEP_ID
from model.transformer import Decoder, check_tokens, default_positions, shift_right


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
  kind = "decoder_only"  # model.type (model/build.py)

  def setup(self):
    self.decoder = Decoder(self.config, cross_attention=False)

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
    return self.decoder(
      tokens, positions, None, mask, None, deterministic, project_from=inputs.shape[1]
    )

  def _stack(self, variables, tokens, positions=None):
    """The stack in decode mode over `tokens` [batch, length] with the cache entries `variables`
    ({kind: tree}; none: create the cache, sized by `tokens`), as an unbound copy on the XLA
    attention path (a query against the cache needs no fused kernel): (logits [batch, length,
    vocab], the carried cache entries)."""
    stack = Decoder(
      dataclasses.replace(self.config, attention_impl="xla"), cross_attention=False, parent=None
    )
    logits, state = stack.apply(
      {"params": self.decoder.variables["params"], **variables},
      tokens,
      positions,
      None,
      None,
      None,
      True,
      decode=True,
      mutable=cache_kinds.CARRIED,
    )
    return logits, {kind: state.get(kind, {}) for kind in cache_kinds.CARRIED}

  def init_cache(self, encoded, inputs, max_decode_len: int):
    """Creates the decoding cache (call with `mutable=model.cache_kinds.COLLECTIONS`) and runs every
    row's source through it in one call: the stack's key/value buffers of `src_len +
    max_decode_len` positions (`TARGET` "stack") and its cache indices and next position, each
    row's own [batch] (`STATE` "stack").

    encoded: the source ids from `encode`; inputs: [batch, src_len] ids (0 = pad, anywhere).
    """
    del encoded
    check_tokens("DecoderOnly", "inputs", inputs)
    batch, src_len = inputs.shape
    # Real tokens first, padding after, in each row.
    order = jnp.argsort(inputs == 0, axis=1, stable=True)
    source = jnp.take_along_axis(inputs, order, axis=1)
    lengths = jnp.sum(inputs > 0, axis=1, dtype=jnp.int32)
    dummy = jnp.ones((batch, src_len + max_decode_len), jnp.int32)
    _, cache = self._stack({}, dummy, default_positions(dummy))
    cache_kinds.check_collections(cache, "DecoderOnly")
    _, cache = self._stack(cache, source)
    # Each row goes on from its own source length: the padding written after it is forgotten
    # (masked until overwritten). The stack's `STATE` entries are all such counters.
    cache[cache_kinds.STATE] = jax.tree_util.tree_map(lambda _: lengths, cache[cache_kinds.STATE])
    for kind in cache_kinds.CARRIED:
      self.put_variable(kind, "stack", cache[kind])

  def decode_step(self, ids):
    """One decoding step from the cache (call with `mutable=model.cache_kinds.CARRIED`).

    ids: [batch, 1], the previous target token; 0 (the start symbol) is read as SEP.
    Returns [batch, vocab].
    """
    if ids.ndim != 2 or ids.shape[1] != 1:
      raise ValueError(f"DecoderOnly.decode_step: ids must be [batch, 1], got {ids.shape}")
    ids = jnp.where(ids == 0, SEP_ID, ids)
    cache = {kind: self.get_variable(kind, "stack") for kind in cache_kinds.CARRIED}
    logits, cache = self._stack(cache, ids)
    for kind in cache_kinds.CARRIED:
      self.put_variable(kind, "stack", cache[kind])
    return logits[:, 0]
