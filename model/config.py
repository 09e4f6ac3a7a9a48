"""The model's hyperparameters, with the paper's names, checked once when built."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

# The computation dtypes a model may take, by name.
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# Decoding only: int8 products (model/quantize.py), float32 everywhere else.
INT8 = "int8"
ATTENTION_IMPLS = ("xla", "cudnn")
FFN_ACTIVATIONS = ("relu", "swish", "gelu")
POSITION_LAYOUTS = ("interleaved", "concatenated")
POSITION_FREQUENCIES = ("paper", "marian")
DECODER_STARTS = ("token", "zero")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Hyperparameters of the encoder-decoder (paper section 3 and table 3).

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

  vocab_size: int
  d_model: int = 512
  d_ff: int = 2048
  num_heads: int = 8
  num_layers: int = 6
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.0
  share_embeddings: bool = True
  max_len: int = 256
  pre_ln: bool = False
  dtype: str = "float32"
  remat: bool = False
  attention_impl: str = "xla"
  # What models from other engines need (formats/marian.py); the defaults are the paper's.
  ffn_activation: str = "relu"
  position_layout: str = "interleaved"
  position_frequencies: str = "paper"
  layer_norm_epsilon: float = 1e-6
  decoder_start: str = "token"
  attention_bias: bool = False
  output_bias: bool = False
  raw_self_keys: bool = False

  def __post_init__(self):
    def bad(field, why):
      raise ValueError(f"config error: model.{field}={getattr(self, field)!r}: {why}")

    for field in ("vocab_size", "d_model", "d_ff", "num_heads", "num_layers", "max_len"):
      if int(getattr(self, field)) <= 0:
        bad(field, "must be a positive integer")
    if self.d_model % self.num_heads:
      bad(
        "d_model",
        f"must be divisible by model.num_heads={self.num_heads} (d_k = d_model / num_heads)",
      )
    if self.d_model % 2:
      bad("d_model", "must be even (the sinusoidal position encoding pairs sin and cos)")
    for field in ("dropout_rate", "attention_dropout_rate"):
      if not 0.0 <= getattr(self, field) < 1.0:
        bad(field, "must be in [0, 1)")
    if self.dtype not in DTYPES and self.dtype != INT8:
      bad("dtype", f"must be one of {sorted([*DTYPES, INT8])}")
    for field, allowed in (
      ("ffn_activation", FFN_ACTIVATIONS),
      ("position_layout", POSITION_LAYOUTS),
      ("position_frequencies", POSITION_FREQUENCIES),
      ("decoder_start", DECODER_STARTS),
    ):
      if getattr(self, field) not in allowed:
        bad(field, f"must be one of {allowed}")
    if not 0.0 < self.layer_norm_epsilon < 1.0:
      bad("layer_norm_epsilon", "must be in (0, 1)")
    if self.attention_impl not in ATTENTION_IMPLS:
      bad("attention_impl", f"must be one of {ATTENTION_IMPLS}")
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

  @classmethod
  def from_config(cls, model_cfg: Any, **overrides) -> TransformerConfig:
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
