"""The encoder-decoder Transformer (paper section 3, figure 1).

    logits = Transformer(cfg).apply({'params': p}, inputs, targets)   # [batch, tgt_len, vocab]

Token id 0 is padding; targets end with EOS and are shifted right inside `decode` (teacher
forcing), so position t predicts targets[:, t]. Packed rows carry segment ids and positions.
Incremental decoding: `init_cache` once per batch, then `decode_step` per target position.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from model import cache_kinds, distribution, masks
from model.config import TransformerConfig
from model.dropout import Dropout
from model.layers import (
  DecoderLayer,
  Dense,
  Embed,
  EncoderLayer,
  layer_norm,
  maybe_remat,
  position_encoding,
)
from model.special_tokens import PAD_ID
from model.stored_params import StoredParams


def shift_right(targets: jax.Array, segmentation: jax.Array | None = None) -> jax.Array:
  """Decoder inputs for teacher forcing: [batch, length] -> the same shifted one step right with
  0 (the start symbol) in front; with packing, every segment starts with 0 too."""
  if targets.ndim != 2:
    raise ValueError(f"shift_right: targets must be [batch, length], got {targets.shape}")
  shifted = jnp.pad(targets, ((0, 0), (1, 0)))[:, :-1]
  if segmentation is not None:
    prev_seg = jnp.pad(segmentation, ((0, 0), (1, 0)))[:, :-1]
    shifted = jnp.where(segmentation == prev_seg, shifted, 0)
  return shifted


def default_positions(tokens: jax.Array) -> jax.Array:
  """[batch, length] -> 0, 1, 2, ... along the length."""
  return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)


def check_tokens(owner: str, name: str, tokens, like=None, like_name=None):
  """Raises a ValueError naming `owner` and the argument unless `tokens` is [batch, length] (and
  `like`, when given, has the same shape)."""
  if tokens.ndim != 2:
    raise ValueError(f"{owner}: {name} must be [batch, length] token ids, got shape {tokens.shape}")
  if like is not None and like.shape != tokens.shape:
    raise ValueError(
      f"{owner}: {like_name} shape {like.shape} must equal {name} shape {tokens.shape}"
    )


class Encoder(nn.Module):
  """Embedding + positions, dropout, N encoder layers (and a final LayerNorm with pre-LN)."""

  config: TransformerConfig
  embed: Embed

  @nn.compact
  def __call__(self, inputs, positions, segmentation, deterministic):
    """inputs: [batch, src_len] ids -> [batch, src_len, d_model]."""
    cfg = self.config
    x = self.embed(inputs) + position_encoding(positions, cfg).astype(cfg.compute_dtype)
    x = Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
    mask = masks.encoder_self_mask(inputs, segmentation)
    layer = maybe_remat(EncoderLayer, cfg, static_argnums=(3,))
    for i in range(cfg.num_layers):
      x = layer(cfg, name=f"layer_{i}")(x, mask, deterministic)
    if cfg.pre_ln:
      x = layer_norm("final_norm", cfg)(x)
    return x


class Decoder(StoredParams):
  """Embedding + positions, dropout, N decoder layers, (final LayerNorm,) output projection;
  without `cross_attention`, a causal stack (model/decoder_only.py). `embed`: the target
  embedding (None: its own, named 'embed')."""

  config: TransformerConfig
  embed: Embed | None = None
  cross_attention: bool = True

  @nn.compact
  def __call__(
    self,
    decoder_inputs,
    positions,
    memory,
    self_mask,
    cross_mask,
    deterministic,
    decode=False,
    return_weights=False,
    project_from=0,
    impossible=None,
  ):
    """decoder_inputs: [batch, tgt_len] ids (already shifted) -> [batch, tgt_len - project_from,
    vocab] logits of the positions from `project_from` on (the others are never projected).
    With `decode` and a cache, the positions are the cache's next `tgt_len` ones. `impossible`
    ([vocab] bool, or None): ids whose logits are -inf (`Embed.attend`)."""
    cfg = self.config
    # The position of each incremental step is counted in the cache: [] shared by all rows, or
    # [batch], each row its own (continuous batching, model/pool.py).
    if decode:
      initialized = self.has_variable(cache_kinds.STATE, "position")
      position = self.variable(cache_kinds.STATE, "position", lambda: jnp.array(0, jnp.int32))
      if initialized:
        steps = decoder_inputs.shape[1]
        after = jnp.reshape(position.value, (-1, 1))
        if steps > 1:  # a prompt filling the cache in one call (model/decoder_only.py)
          after = after + jnp.arange(steps, dtype=jnp.int32)
        # A position shared by all rows is encoded once ([1, steps]), not once per row.
        shared = jnp.ndim(position.value) == 0
        positions = after if shared else jnp.broadcast_to(after, decoder_inputs.shape)
        position.value = position.value + steps
    embed = self.embed
    if embed is None:
      embed = Embed(cfg.vocab_size, cfg.d_model, cfg.compute_dtype, name="embed")
    y = embed(decoder_inputs)
    if cfg.decoder_start == "zero":  # the start symbol (PAD) reads zeros (Marian's first input)
      y = jnp.where((decoder_inputs == PAD_ID)[..., None], jnp.zeros((), y.dtype), y)
    y = y + position_encoding(positions, cfg).astype(cfg.compute_dtype)
    y = Dropout(cfg.dropout_rate)(y, deterministic=deterministic)
    layer = maybe_remat(DecoderLayer, cfg, static_argnums=(5, 6, 7))
    for i in range(cfg.num_layers):
      y = layer(cfg, self.cross_attention, name=f"layer_{i}")(
        y, memory, self_mask, cross_mask, deterministic, decode, return_weights
      )
    if cfg.pre_ln:
      y = layer_norm("final_norm", cfg)(y)
    if project_from:
      y = y[:, project_from:]
    # Decoding takes float32 logits straight from the product's float32 sums.
    if cfg.share_embeddings:
      logits = embed.attend(y, jnp.float32 if decode else None, impossible)
      if cfg.output_bias:
        init = nn.with_logical_partitioning(nn.initializers.zeros, ("vocab",))
        bias = self.param("logits_bias", init, (cfg.vocab_size,), jnp.float32)
        logits = logits + bias.astype(logits.dtype)
    else:
      out_dtype = jnp.float32 if decode else None
      logits = Dense(
        cfg.vocab_size, ("embed", "vocab"), cfg.compute_dtype, out_dtype=out_dtype, name="logits"
      )(y)
      if impossible is not None:
        logits = distribution.mask_where(logits, impossible)
    return logits


class Transformer(nn.Module):
  """Encoder-decoder Transformer. Source and target share one vocabulary when
  `share_embeddings` (the paper ties the two embeddings and the pre-softmax projection)."""

  config: TransformerConfig
  kind = "transformer"  # model.type (model/build.py)

  def setup(self):
    cfg = self.config
    src_embed = Embed(cfg.vocab_size, cfg.d_model, cfg.compute_dtype, name="embed")
    tgt_embed = (
      src_embed
      if cfg.share_embeddings
      else Embed(cfg.vocab_size, cfg.d_model, cfg.compute_dtype, name="target_embed")
    )
    self.encoder = Encoder(cfg, src_embed)
    self.decoder = Decoder(cfg, tgt_embed)

  def encode(self, inputs, inputs_position=None, inputs_segmentation=None, deterministic=True):
    """inputs: [batch, src_len] ids (0 = pad) -> encoded [batch, src_len, d_model]."""
    check_tokens("Transformer", "inputs", inputs)
    if inputs_position is not None:
      check_tokens("Transformer", "inputs", inputs, inputs_position, "inputs_position")
    if inputs_segmentation is not None:
      check_tokens("Transformer", "inputs", inputs, inputs_segmentation, "inputs_segmentation")
    if inputs_position is None:
      inputs_position = default_positions(inputs)
    return self.encoder(inputs, inputs_position, inputs_segmentation, deterministic)

  def decode(
    self,
    encoded,
    inputs,
    targets,
    targets_position=None,
    inputs_segmentation=None,
    targets_segmentation=None,
    deterministic=True,
    return_weights=False,
  ):
    """Teacher-forced decoder over whole target rows.

    encoded: [batch, src_len, d_model]; inputs: [batch, src_len] ids (for the source mask);
    targets: [batch, tgt_len] ids ending in EOS. Returns [batch, tgt_len, vocab] logits.
    """
    check_tokens("Transformer", "targets", targets)
    check_tokens("Transformer", "inputs", inputs)
    if encoded.ndim != 3 or encoded.shape[:2] != inputs.shape:
      raise ValueError(
        f"Transformer.decode: encoded {encoded.shape} must be [batch, src_len, "
        f"d_model] matching inputs {inputs.shape}"
      )
    if targets.shape[0] != inputs.shape[0]:
      raise ValueError(
        f"Transformer: batch sizes differ: inputs {inputs.shape}, targets {targets.shape}"
      )
    for name, arr in (
      ("targets_position", targets_position),
      ("targets_segmentation", targets_segmentation),
    ):
      if arr is not None:
        check_tokens("Transformer", "targets", targets, arr, name)
    if targets_position is None:
      targets_position = default_positions(targets)
    decoder_inputs = shift_right(targets, targets_segmentation)
    self_mask = masks.decoder_self_mask(targets, targets_segmentation)
    cross = masks.cross_mask(targets, inputs, targets_segmentation, inputs_segmentation)
    return self.decoder(
      decoder_inputs,
      targets_position,
      encoded,
      self_mask,
      cross,
      deterministic,
      return_weights=return_weights,
    )

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
    """[batch, src_len], [batch, tgt_len] ids -> [batch, tgt_len, vocab] logits."""
    encoded = self.encode(inputs, inputs_position, inputs_segmentation, deterministic)
    return self.decode(
      encoded,
      inputs,
      targets,
      targets_position,
      inputs_segmentation,
      targets_segmentation,
      deterministic,
    )

  def init_cache(self, encoded, inputs, max_decode_len: int):
    """Creates the decoding cache (call with `mutable=model.cache_kinds.COLLECTIONS`): empty
    self-attention key/value buffers of `max_decode_len` positions (`TARGET`), the projected
    encoder keys/values and source mask (`SOURCE`), the decode indices (`STATE`).

    encoded: [batch, src_len, d_model]; inputs: [batch, src_len] ids.
    """
    check_tokens("Transformer", "inputs", inputs)
    dummy = jnp.ones((inputs.shape[0], max_decode_len), jnp.int32)
    cross = masks.cross_mask(dummy, inputs)
    self.decoder(dummy, default_positions(dummy), encoded, None, cross, True, decode=True)

  # `decode_step(masked=True)` gives the searches' masked logits itself (model/decoder_state.py);
  # model/build.py's MASKS_LOGITS names the types that do.
  masks_logits = True

  def decode_step(self, ids, return_weights=False, masked=False, num_ids=None):
    """One decoding step from the cache (call with `mutable=model.cache_kinds.CARRIED`).

    ids: [batch, 1], the previous target token (0 at the first step). Returns [batch, vocab].
    With `masked`, float32 logits with the ids `distribution.mask(logits, num_ids)` makes
    impossible at -inf, the rest unchanged (folded into the output product: `Embed.attend`).
    """
    if ids.ndim != 2 or ids.shape[1] != 1:
      raise ValueError(f"Transformer.decode_step: ids must be [batch, 1], got {ids.shape}")
    never = distribution.impossible(self.config.vocab_size, num_ids) if masked else None
    rest = dict(decode=True, return_weights=return_weights, impossible=never)
    logits = self.decoder(ids, None, None, None, None, True, **rest)
    return logits[:, 0, :]
