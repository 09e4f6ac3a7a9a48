"""The model's hyperparameters, with the paper's names: each field's default, meaning and rule
written once, here, as

    d_ff: int = hyperparameter(2048, "inner width of the feed-forward network", Int(min=1))

configs/common.py makes its `model.*` config fields of these (default, help for `--show_config`,
rule), model/build.py reads from them which fields a model type ignores, and building a config
checks every field against its rule, then the fields together (d_model and num_heads, ...).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from core.rules import Bool, Choice, Float, Int, Rule, RuleError

# The model types model/build.py builds (config.model.type); the first is the default.
MODEL_TYPES = ("transformer", "rnn", "rnn_attention", "decoder_only")
# The computation dtypes a model may take, by name: the one list (configs/common.py's
# model.dtype and decoding's choices, inference/translator.py, are made of it).
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# Decoding only: int8 products (model/quantize.py), float32 everywhere else.
INT8 = "int8"
# A config's model.dtype (and decoding's dtype) for 'the dtype the devices multiply fastest'
# (core/cpu.py), resolved before a model is built.
AUTO = "auto"
ATTENTION_IMPLS = ("xla", "cudnn")
CELLS = ("gru", "lstm")
FFN_ACTIVATIONS = ("relu", "swish", "gelu")
POSITION_LAYOUTS = ("interleaved", "concatenated")
POSITION_FREQUENCIES = ("paper", "marian")
DECODER_STARTS = ("token", "zero")

HELP, RULE, CONFIG_DEFAULT, RESOLVED = "help", "rule", "config_default", "resolved"
REQUIRED = dataclasses.MISSING  # a hyperparameter without a default (the config says it)
POSITIVE = Int(min=1)
FRACTION = Float(min=0.0, below=1.0)


def hyperparameter(
  default: Any, help: str, rule: Rule, *, config_default: Any = None, resolved: tuple = ()
) -> Any:
  """A field of a config dataclass below: its default (REQUIRED: none), what it means (one line,
  `--show_config` prints it) and the rule of its values (core/rules.py). `resolved`: values a
  config may hold that are replaced before the model is built (configs/common.py accepts them,
  the model does not); `config_default`: the config's default of a REQUIRED field."""
  metadata = {HELP: help, RULE: rule, CONFIG_DEFAULT: config_default, RESOLVED: resolved}
  if default is REQUIRED:
    return dataclasses.field(metadata=metadata)
  return dataclasses.field(default=default, metadata=metadata)


def shared(config_class: type, name: str) -> Any:
  """The declaration of `config_class`'s field `name`, for another model type that takes the
  same hyperparameter (its default, meaning and rule stay written once)."""
  (field,) = [f for f in dataclasses.fields(config_class) if f.name == name]
  return hyperparameter(
    field.default,
    field.metadata[HELP],
    field.metadata[RULE],
    config_default=field.metadata[CONFIG_DEFAULT],
    resolved=field.metadata[RESOLVED],
  )


class _Hyperparameters:
  """What the config dataclasses share: the rules checked when built, `from_config`."""

  def __post_init__(self):
    for field in dataclasses.fields(self):
      try:
        field.metadata[RULE].check(getattr(self, field.name))
      except RuleError as e:
        self._bad(field.name, str(e))
    self._check_together()

  def _check_together(self) -> None:
    """The checks of several fields together (a subclass's)."""

  def _bad(self, field: str, why: str):
    raise ValueError(f"config error: model.{field}={getattr(self, field)!r}: {why}")

  @classmethod
  def from_config(cls, model_cfg: Any, **overrides):
    """Builds from the `config.model` ConfigDict, taking the fields this class knows."""
    fields = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in dict(model_cfg).items() if k in fields}
    values.update(overrides)
    missing = [
      f.name
      for f in dataclasses.fields(cls)
      if f.default is dataclasses.MISSING and f.name not in values
    ]
    if missing:
      raise ValueError(f"config error: model.{missing[0]} is required")
    return cls(**values)


@dataclasses.dataclass(frozen=True)
class TransformerConfig(_Hyperparameters):
  """Hyperparameters of the encoder-decoder (paper section 3 and table 3), and of the
  decoder-only model.

  `num_layers` is per stack (N in the paper). `dtype` is the computation dtype; parameters are
  always float32. 'int8' is for decoding: products in int8 from matrices quantized before the
  search (model/decoder_state.py's `matrices_for_decoding`), float32 everywhere else.
  `attention_impl='cudnn'` uses `jax.nn.dot_product_attention`'s cuDNN kernel (GPU,
  bfloat16/float16 only) wherever there is no attention dropout (training with
  `attention_dropout_rate > 0` takes the 'xla' path, which applies it); 'xla' is the reference.

  The last block is what models from other engines need (formats/marian.py), the paper's
  computation by default: the FFN activation, the sinusoid table's layout and frequencies
  (model/layers.py `sinusoidal_encoding`), the LayerNorm epsilon, the decoder's first input (the
  start symbol's embedding, or zeros), biases on the attention projections and on a tied output
  projection, and `raw_self_keys` (pre-LN incremental decoding attends over keys and values of
  the un-normalised layer inputs after the first step, as Marian's decoder does).
  """

  vocab_size: int = hyperparameter(
    REQUIRED, "embedding rows and logits; 0 = the vocabulary's size", POSITIVE, config_default=0
  )
  d_model: int = hyperparameter(
    512, "width of embeddings and of every sub-layer's output (d_model)", Int(min=2)
  )
  d_ff: int = hyperparameter(
    2048, "inner width of the position-wise feed-forward network (d_ff)", POSITIVE
  )
  num_heads: int = hyperparameter(8, "attention heads (h); d_model must divide by it", POSITIVE)
  num_layers: int = hyperparameter(6, "layers per stack (N)", POSITIVE)
  dropout_rate: float = hyperparameter(
    0.1, "dropout on sub-layer outputs and on embeddings + positions (P_drop)", FRACTION
  )
  attention_dropout_rate: float = hyperparameter(0.0, "dropout on the attention weights", FRACTION)
  share_embeddings: bool = hyperparameter(
    True, "tie source and target embeddings and the pre-softmax projection", Bool()
  )
  max_len: int = hyperparameter(
    256, "longest sequence the model takes; longer decoding inputs are cut to it", POSITIVE
  )
  pre_ln: bool = hyperparameter(
    False, "LayerNorm before each sub-layer instead of after the residual (the paper's)", Bool()
  )
  dtype: str = hyperparameter(
    "float32",
    "computation dtype (params, Adam float32); auto: bfloat16 if faster, else float32; "
    "int8: decoding",
    Choice(*DTYPES, INT8),
    resolved=(AUTO,),
  )
  remat: bool = hyperparameter(
    False, "recompute each layer's activations in the backward pass (less memory)", Bool()
  )
  attention_impl: str = hyperparameter(
    "xla",
    "'xla', or 'cudnn' (cuDNN's fused attention: NVIDIA GPUs, bfloat16)",
    Choice(*ATTENTION_IMPLS),
  )
  # What models from other engines need (formats/marian.py); the defaults are the paper's.
  ffn_activation: str = hyperparameter(
    "relu",
    "FFN activation: relu (the paper's), swish (x sigmoid(x)), gelu (x sigmoid(1.702x), Marian's)",
    Choice(*FFN_ACTIVATIONS),
  )
  position_layout: str = hyperparameter(
    "interleaved",
    "sinusoid table: interleaved (sin even, cos odd channels) or concatenated (sin half, cos half)",
    Choice(*POSITION_LAYOUTS),
  )
  position_frequencies: str = hyperparameter(
    "paper",
    "sinusoid frequencies: paper (1/10000^(2i/d_model)) or marian (exp(-i ln 1e4 / (d/2 - 1)))",
    Choice(*POSITION_FREQUENCIES),
  )
  layer_norm_epsilon: float = hyperparameter(1e-6, "LayerNorm epsilon", Float(above=0.0, below=1.0))
  decoder_start: str = hyperparameter(
    "token",
    "the decoder's first input: token (the start symbol's embedding) or zero (Marian's zeros)",
    Choice(*DECODER_STARTS),
  )
  attention_bias: bool = hyperparameter(
    False, "biases on the attention projections W^Q, W^K, W^V, W^O (Marian's)", Bool()
  )
  output_bias: bool = hyperparameter(
    False, "a bias on the tied pre-softmax projection (an untied one always has one)", Bool()
  )
  raw_self_keys: bool = hyperparameter(
    False,
    "pre_ln decoding: self-attention keys/values of un-normalised inputs after step 0 (Marian's)",
    Bool(),
  )

  def _check_together(self) -> None:
    bad = self._bad
    if self.d_model % self.num_heads:
      bad(
        "d_model",
        f"must be divisible by model.num_heads={self.num_heads} (d_k = d_model / num_heads)",
      )
    if self.d_model % 2:
      bad("d_model", "must be even (the sinusoidal position encoding pairs sin and cos)")
    if self.attention_impl == "cudnn" and self.dtype == "float32":
      bad(
        "attention_impl",
        "cuDNN's fused attention takes bfloat16 or float16 only; set "
        "model.dtype=bfloat16 or use attention_impl='xla'",
      )
    d_k = self.d_model // self.num_heads
    if self.attention_impl == "cudnn" and (d_k % 8 or d_k > 256):
      bad(
        "attention_impl",
        f"cuDNN's fused attention needs a head width d_k = d_model / "
        f"num_heads that is a multiple of 8 and at most 256 (128 before Hopper GPUs); "
        f"d_k = {self.d_model} / {self.num_heads} = {d_k}",
      )

  @property
  def compute_dtype(self):
    return jnp.float32 if self.dtype == INT8 else DTYPES[self.dtype]


@dataclasses.dataclass(frozen=True)
class RNNConfig(_Hyperparameters):
  """Hyperparameters of the recurrent models (model/rnn.py); the fields they share with the
  Transformer are its declarations.

  `d_model` is the embedding size and the hidden size of every layer (each direction);
  `num_layers` stacked layers in the encoder and in the decoder; `max_len` is kept for the shared
  interface (the recurrence has no length limit); `dtype` is the computation dtype (not int8).
  """

  vocab_size: int = shared(TransformerConfig, "vocab_size")
  d_model: int = shared(TransformerConfig, "d_model")
  num_layers: int = shared(TransformerConfig, "num_layers")
  dropout_rate: float = shared(TransformerConfig, "dropout_rate")
  rnn_cell: str = hyperparameter(
    "gru", "recurrent cell of model.type rnn / rnn_attention", Choice(*CELLS)
  )
  rnn_bidirectional: bool = hyperparameter(
    True, "bidirectional encoder of model.type rnn / rnn_attention", Bool()
  )
  share_embeddings: bool = shared(TransformerConfig, "share_embeddings")
  max_len: int = shared(TransformerConfig, "max_len")
  dtype: str = shared(TransformerConfig, "dtype")

  def _check_together(self) -> None:
    if self.dtype == INT8:
      self._bad("dtype", f"int8 products are not for a recurrent model; one of {list(DTYPES)}")

  @property
  def compute_dtype(self):
    return DTYPES[self.dtype]

  @property
  def context_size(self) -> int:
    """Width of an encoder state: d_model, twice that when bidirectional."""
    return self.d_model * (2 if self.rnn_bidirectional else 1)
