"""Builds the model named by `config.model.type` from the `config.model` fields.

Every model type takes the same batch and offers the same methods, so training, decoding and
benchmarking never branch on the type:
  __call__(inputs, targets, inputs_position, targets_position, inputs_segmentation,
           targets_segmentation, deterministic) -> [batch, tgt_len, vocab] logits
  encode(inputs, ...) -> encoder output;  init_cache(encoded, inputs, max_decode_len);
  decode_step(ids [batch, 1]) -> [batch, vocab] logits (the cache in the collections of
  model/cache_kinds.py).

Types: 'transformer' (model/transformer.py), 'rnn' and 'rnn_attention' (model/rnn.py),
'decoder_only' (model/decoder_only.py). A `config.model` option that does not apply to the chosen
type is ignored, with a warning when it differs from its default.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from absl import logging

from model.config import MODEL_TYPES, RNNConfig, TransformerConfig
from model.decoder_only import DecoderOnly
from model.rnn import RNNSeq2Seq
from model.transformer import Transformer


def _only_in(config_class, other) -> dict[str, Any]:
  """The fields of `config_class` that `other` has not, with their defaults."""
  theirs = {f.name for f in dataclasses.fields(other)}
  return {f.name: f.default for f in dataclasses.fields(config_class) if f.name not in theirs}


# Options used by some types only, with their defaults (model/config.py); options not listed
# here apply to every type.
_TRANSFORMER_ONLY = _only_in(TransformerConfig, RNNConfig)
_RNN_ONLY = _only_in(RNNConfig, TransformerConfig)
_IGNORED = {
  "transformer": _RNN_ONLY,
  "decoder_only": _RNN_ONLY,
  "rnn": _TRANSFORMER_ONLY,
  "rnn_attention": _TRANSFORMER_ONLY,
}


def _warn_ignored(kind: str, model_cfg: Any):
  """Warns about each option that `kind` ignores but that was changed from its default."""
  for name, default in _IGNORED[kind].items():
    if name in model_cfg and model_cfg[name] != default:
      logging.warning(
        "model.%s=%r does not apply to model.type=%r and is ignored", name, model_cfg[name], kind
      )


def hyperparameters(model_cfg: Any) -> TransformerConfig | RNNConfig:
  """The checked hyperparameters of `config.model`'s type (a ValueError names a bad field)."""
  kind = model_cfg.get("type", "transformer")
  if kind not in MODEL_TYPES:
    raise ValueError(
      f"config error: model.type={kind!r} is unknown; valid types: {', '.join(MODEL_TYPES)}"
    )
  if kind in ("transformer", "decoder_only"):
    return TransformerConfig.from_config(model_cfg)
  return RNNConfig.from_config(model_cfg)


def build_model(model_cfg: Any) -> nn.Module:
  """`config.model` (a ConfigDict or dict) -> a Flax module."""
  kind = model_cfg.get("type", "transformer")
  config = hyperparameters(model_cfg)
  _warn_ignored(kind, model_cfg)
  if kind == "transformer":
    return Transformer(config)
  if kind == "decoder_only":
    return DecoderOnly(config)
  return RNNSeq2Seq(config, attention=kind == "rnn_attention")


def init_variables(
  model: nn.Module, rng: jax.Array, batch_size: int = 1, src_len: int = 8, tgt_len: int = 8
):
  """Initial variables (with logical-axis metadata boxes) from dummy token batches."""
  inputs = jnp.ones((batch_size, src_len), jnp.int32)
  targets = jnp.ones((batch_size, tgt_len), jnp.int32)
  return model.init(rng, inputs, targets)


def abstract_params(model_cfg: Any):
  """The parameter tree as ShapeDtypeStructs (nothing allocated): for counting and restoring."""
  model = build_model(model_cfg)
  variables = jax.eval_shape(lambda: init_variables(model, jax.random.key(0)))
  return nn.unbox(variables["params"])
