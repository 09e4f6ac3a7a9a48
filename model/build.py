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

`DeferredModel(model_cfg)` is `build_model(model_cfg)` made on first use: a decoding process that
reads its compiled searches back never traces, so never imports Flax and the linen modules
(docs/experiments.md has the seconds).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging

from model.config import MODEL_TYPES, RNNConfig, TransformerConfig

# The types whose `decode_step(masked=True)` masks its own logits (`Transformer.masks_logits`).
MASKS_LOGITS = ("transformer",)


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


def build_model(model_cfg: Any):
  """`config.model` (a ConfigDict or dict) -> a Flax module (`kind` its model type)."""
  return DeferredModel(model_cfg).module


class DeferredModel:
  """`build_model(model_cfg)`, built on first use of anything but `kind` (the model type),
  `config` (its checked hyperparameters) and `masks_logits`: those are known at once, and are
  all a decoding run that reads its searches back asks of it. Options that do not apply to the
  type are warned about here, once."""

  def __init__(self, model_cfg: Any):
    self.kind = model_cfg.get("type", "transformer")
    self.config = hyperparameters(model_cfg)
    self.masks_logits = self.kind in MASKS_LOGITS
    _warn_ignored(self.kind, model_cfg)
    self._module = None

  @property
  def module(self):
    """The linen module (built, its module and Flax imported, on the first call). Two threads
    tracing at once may each build one: equal modules (a linen module is its fields)."""
    if self._module is None:
      if self.kind == "transformer":
        from model.transformer import Transformer

        self._module = Transformer(self.config)
      elif self.kind == "decoder_only":
        from model.decoder_only import DecoderOnly

        self._module = DecoderOnly(self.config)
      else:
        from model.rnn import RNNSeq2Seq

        self._module = RNNSeq2Seq(self.config, attention=self.kind == "rnn_attention")
    return self._module

  def __getattr__(self, name: str):  # only for names not set in __init__
    if name.startswith("__") or name == "_module":
      raise AttributeError(name)
    return getattr(self.module, name)

  def __repr__(self) -> str:
    return f"DeferredModel({self.kind!r}, {self.config!r})"


def init_variables(model, rng: jax.Array, batch_size: int = 1, src_len: int = 8, tgt_len: int = 8):
  """Initial variables (with logical-axis metadata boxes) from dummy token batches."""
  inputs = jnp.ones((batch_size, src_len), jnp.int32)
  targets = jnp.ones((batch_size, tgt_len), jnp.int32)
  return model.init(rng, inputs, targets)


def abstract_params(model_cfg: Any):
  """The parameter tree as ShapeDtypeStructs (nothing allocated): for counting and restoring."""
  import flax.linen as nn

  model = build_model(model_cfg)
  variables = jax.eval_shape(lambda: init_variables(model, jax.random.key(0)))
  return nn.unbox(variables["params"])
