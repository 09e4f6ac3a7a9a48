"""Builds the model named by `config.model.type` from the `config.model` fields.

Every model type takes the same batch and offers the same methods, so training, decoding and
benchmarking never branch on the type:
  __call__(inputs, targets, inputs_position, targets_position, inputs_segmentation,
           targets_segmentation, deterministic) -> [batch, tgt_len, vocab] logits
  encode(inputs, ...) -> encoder output;  init_cache(encoded, inputs, max_decode_len);
  decode_step(ids [batch, 1]) -> [batch, vocab] logits (both with mutable=['cache']).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import flax.linen as nn

from model.config import TransformerConfig
from model.transformer import Transformer

MODEL_TYPES = ("transformer",)


def build_model(model_cfg: Any) -> nn.Module:
  """`config.model` (a ConfigDict or dict) -> a Flax module."""
  kind = model_cfg.get("type", "transformer")
  if kind == "transformer":
    return Transformer(TransformerConfig.from_config(model_cfg))
  raise ValueError(f"config error: model.type={kind!r} is unknown; valid types: "
                   f"{', '.join(MODEL_TYPES)}")


def init_variables(model: nn.Module, rng: jax.Array, batch_size: int = 1, src_len: int = 8,
                   tgt_len: int = 8):
  """Initial variables (with logical-axis metadata boxes) from dummy token batches."""
  inputs = jnp.ones((batch_size, src_len), jnp.int32)
  targets = jnp.ones((batch_size, tgt_len), jnp.int32)
  return model.init(rng, inputs, targets)


def abstract_params(model_cfg: Any):
  """The parameter tree as ShapeDtypeStructs (nothing allocated): for counting and restoring."""
  model = build_model(model_cfg)
  variables = jax.eval_shape(lambda: init_variables(model, jax.random.key(0)))
  return nn.unbox(variables["params"])
