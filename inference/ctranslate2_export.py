"""A trained Transformer workdir as a CTranslate2 model directory (model.bin, config.json,
shared_vocabulary.json; our vocabulary file for text in and out, and limits.json with the longest
source the model takes, `model.max_len`, to which sources are cut as decode.py cuts them), for
serving with `ctranslate2.Translator` on CPUs (inference/ctranslate2_translate.py), optionally
quantized; the command line is cli/ctranslate2_export.py.

    pip install 'attention-jax[ctranslate2]'
    python -m cli.ctranslate2_export --workdir=runs/m30k --output=m30k_ct2 \
        [--checkpoint=latest|<step>|average:<k>] [--quantization=int8]

    translator = ctranslate2.Translator("m30k_ct2", compute_type="int8")
    texts = translate_texts(translator, Pieces(vocab), lines, beam_size=1)  # ctranslate2_translate

The model is written through CTranslate2's spec API (`ctranslate2.specs.TransformerSpec`), every
weight mapped from ours (model/layers.py): LayerNorms before or after each sublayer as
`model.pre_ln` says (and the stacks' final LayerNorms with pre-LN), the embeddings scaled by
√d_model, Q/K/V fused into CTranslate2's projections (no biases, as ours), the output projection
tied to the embedding with `model.share_embeddings`, and our sinusoidal table (sin and cos
interleaved, positions from 0) written out as the position encodings: CTranslate2's own table
concatenates sin and cos. The output layer gets a bias of NEVER on PAD (zero elsewhere, or our
logits bias): our searches never emit PAD, the decoder's start symbol. CTranslate2 appends our EOS
to each source itself (`add_source_eos`), so sources are given without it.

How sentences are searched and cut to length, identically to `decode.py
--length_penalty=fairseq`: inference/ctranslate2_translate.py.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from absl import logging

from core.errors import ArgumentError, RunError, UsageError
from data.tokenizer import workdir_name
from inference.ctranslate2_translate import LIMITS_NAME, QUANTIZATIONS, Pieces, import_ctranslate2
from inference.restore import load_for_inference
from model.config import TransformerConfig
from model.layers import position_encoding, sinusoidal_encoding
from model.special_tokens import EOS_ID, PAD_ID, UNK_ID

POSITIONS = 1024  # rows of the position table: CTranslate2 truncates sources at 1024 by default
NEVER = -1e4  # the output bias of PAD: exp(NEVER) is 0 in float32 and float16 softmaxes
LAYER_NORM_EPSILON = 1e-6  # flax.linen.LayerNorm's (model.layer_norm_epsilon's default)
# model.ffn_activation -> CTranslate2's activation (Marian's gelu is x sigmoid(1.702 x)).
_ACTIVATIONS = {"relu": "RELU", "swish": "SWISH", "gelu": "GELUSigmoid"}


# ----------------------------------------------------------------------------- the model
def check_model_type(model_cfg) -> None:
  """A UsageError unless `model_cfg` (config.model) is the encoder-decoder Transformer."""
  kind = model_cfg.get("type", "transformer")
  if kind != "transformer":
    raise UsageError(
      f"model.type={kind!r}: the CTranslate2 export covers the encoder-decoder Transformer "
      f"(model.type='transformer') only"
    )


def _matrix(kernel, inputs: int) -> np.ndarray:
  """One of our kernels as CTranslate2's [out, in] weight; `inputs`: how many leading axes are
  the input (1 for W^Q/K/V's [d_model, heads, d_k], 2 for W^O's [heads, d_k, d_model])."""
  k = np.asarray(kernel, np.float32)
  return k.reshape(int(np.prod(k.shape[:inputs])), -1).T


def _norm(spec, tree) -> None:
  spec.gamma = np.asarray(tree["norm"]["scale"], np.float32)
  spec.beta = np.asarray(tree["norm"]["bias"], np.float32)


def _dense(spec, tree) -> None:
  spec.weight = _matrix(tree["kernel"], 1)
  spec.bias = np.asarray(tree["bias"], np.float32)


def _attention(spec, tree, cross: bool) -> None:
  """Our MultiHeadAttention's W^Q, W^K, W^V, W^O as CTranslate2's projections: self-attention
  has [Q; K; V] then the output; encoder-decoder attention has Q, [K; V] then the output (and
  their biases, with `model.attention_bias`)."""
  q, k, v = (_matrix(tree[name]["kernel"], 1) for name in ("query", "key", "value"))
  fused = [q, np.concatenate([k, v])] if cross else [np.concatenate([q, k, v])]
  for linear, weight in zip(spec.linear, [*fused, _matrix(tree["out"]["kernel"], 2)]):
    linear.weight = weight
  if "query_bias" in tree:
    qb, kb, vb = (
      np.asarray(tree[f"{n}_bias"], np.float32).reshape(-1) for n in ("query", "key", "value")
    )
    fused = [qb, np.concatenate([kb, vb])] if cross else [np.concatenate([qb, kb, vb])]
    for linear, bias in zip(spec.linear, [*fused, np.asarray(tree["out"]["bias"], np.float32)]):
      linear.bias = bias


def _ffn(spec, layer) -> None:
  _norm(spec.layer_norm, layer["ffn_block"])
  _dense(spec.linear_0, layer["ffn"]["wi"])
  _dense(spec.linear_1, layer["ffn"]["wo"])


def position_table(d_model: int, positions: int = POSITIONS, cfg=None) -> np.ndarray:
  """[positions, d_model] float32: our sinusoidal encoding of positions 0, 1, ... (model/layers),
  in the layout and frequencies `cfg` (a TransformerConfig) names, the paper's without one."""
  index = jnp.arange(positions)[None]
  table = sinusoidal_encoding(index, d_model) if cfg is None else position_encoding(index, cfg)
  return np.asarray(table[0], np.float32)


def transformer_spec(model_cfg, params, pieces: Sequence[str], positions: int = POSITIONS):
  """Our Transformer (`model_cfg` = config.model, `params` its parameter tree, numpy or jax) as a
  `ctranslate2.specs.TransformerSpec` with the vocabulary `pieces` (the piece of each id; the
  embeddings keep their first len(pieces) rows: ids beyond the vocabulary are never read, and
  ours never emits them). Not yet validated or quantized (`write_model` does both)."""
  ctranslate2 = import_ctranslate2()
  specs = ctranslate2.specs
  check_model_type(model_cfg)
  cfg = TransformerConfig.from_config(model_cfg)
  n = len(pieces)
  if n > cfg.vocab_size:
    raise UsageError(
      f"the vocabulary has {n} pieces but the model only model.vocab_size={cfg.vocab_size} ids"
    )
  if cfg.raw_self_keys:
    raise UsageError(
      "model.raw_self_keys=True (Marian's pre-norm decoding): CTranslate2's decoder attends over "
      "normalised keys only, so its export would translate otherwise"
    )
  activation = getattr(specs.common_spec.Activation, _ACTIVATIONS[cfg.ffn_activation])
  stack = dict(pre_norm=cfg.pre_ln, activation=activation)
  encoder = specs.TransformerEncoderSpec(cfg.num_layers, cfg.num_heads, **stack)
  decoder = specs.TransformerDecoderSpec(cfg.num_layers, cfg.num_heads, **stack)
  decoder.start_from_zero_embedding = cfg.decoder_start == "zero"
  table = position_table(cfg.d_model, positions, cfg)
  source = np.asarray(params["embed"]["embedding"], np.float32)[:n]
  target = source
  if not cfg.share_embeddings:
    target = np.asarray(params["target_embed"]["embedding"], np.float32)[:n]
  encoder.embeddings[0].weight = source
  decoder.embeddings.weight = target
  for stack in (encoder, decoder):
    stack.scale_embeddings = True  # × √d_model, as our Embed
    stack.position_encodings.encodings = table
  if cfg.share_embeddings:
    decoder.projection.weight = target
    bias = np.zeros(n, np.float32)
    if cfg.output_bias:
      bias = np.asarray(params["decoder"]["logits_bias"], np.float32)[:n].copy()
  else:
    logits = params["decoder"]["logits"]
    decoder.projection.weight = _matrix(logits["kernel"], 1)[:n]
    bias = np.asarray(logits["bias"], np.float32)[:n].copy()
  bias[PAD_ID] = NEVER
  decoder.projection.bias = bias
  for i, layer in enumerate(encoder.layer):
    ours = params["encoder"][f"layer_{i}"]
    _norm(layer.self_attention.layer_norm, ours["attention_block"])
    _attention(layer.self_attention, ours["self_attention"], cross=False)
    _ffn(layer.ffn, ours)
  for i, layer in enumerate(decoder.layer):
    ours = params["decoder"][f"layer_{i}"]
    _norm(layer.self_attention.layer_norm, ours["self_attention_block"])
    _attention(layer.self_attention, ours["self_attention"], cross=False)
    _norm(layer.attention.layer_norm, ours["cross_attention_block"])
    _attention(layer.attention, ours["cross_attention"], cross=True)
    _ffn(layer.ffn, ours)
  if cfg.pre_ln:
    _norm(encoder.layer_norm, {"norm": params["encoder"]["final_norm"]})
    _norm(decoder.layer_norm, {"norm": params["decoder"]["final_norm"]})
  spec = specs.TransformerSpec(encoder, decoder)
  spec.config.layer_norm_epsilon = cfg.layer_norm_epsilon
  spec.config.unk_token = pieces[UNK_ID]
  spec.config.eos_token = pieces[EOS_ID]
  spec.config.bos_token = pieces[PAD_ID]
  spec.config.decoder_start_token = pieces[PAD_ID]  # targets are shifted right with PAD
  spec.config.add_source_eos = True
  spec.register_source_vocabulary(list(pieces))
  spec.register_target_vocabulary(list(pieces))
  return spec


def _bfloat16_without_torch(spec, quantization: str) -> None:
  """CTranslate2 converts float32 to bfloat16 through torch; without it, the arrays of the
  validated `spec` it would convert are cast here (numpy's bfloat16 from ml_dtypes, which JAX
  brings): all float arrays for 'bfloat16', those not quantized to int8 for 'int8_bfloat16'."""
  from ctranslate2.specs import model_spec

  def cast(layer, name, value):
    quantized = quantization != "bfloat16" and hasattr(layer, f"{name.split('/')[-1]}_scale")
    if isinstance(value, model_spec.NumpyVariable) and value.dtype == "float32" and not quantized:
      value.array = value.array.astype(jnp.bfloat16)

  model_spec.visit_spec(spec, cast)


def check_output(output) -> pathlib.Path:
  """The output directory, checked before any work: it may exist only as an empty directory, and
  it (or the nearest folder above it that exists) must be writable. An ArgumentError otherwise."""
  path = pathlib.Path(output)
  if path.exists():
    if not path.is_dir():
      raise ArgumentError("output", output, "exists and is not a directory")
    if any(path.iterdir()):
      raise ArgumentError("output", output, "exists and is not empty; give a new directory")
    where = path
  else:
    where = next(p for p in path.absolute().parents if p.exists())
    if not where.is_dir():
      raise ArgumentError("output", output, f"{where} is not a directory")
  if not os.access(where, os.W_OK | os.X_OK):
    raise ArgumentError("output", output, f"{where} is not writable")
  return path


def _check_quantization(quantization: str | None) -> None:
  if quantization is not None and quantization not in QUANTIZATIONS:
    raise ArgumentError("quantization", quantization, f"expected one of {', '.join(QUANTIZATIONS)}")


def write_model(spec, output, quantization: str | None = None) -> pathlib.Path:
  """Validates `spec`, quantizes its weights (`quantization`: one of QUANTIZATIONS, None =
  float32) and saves it into the new directory `output` (see `check_output`)."""
  _check_quantization(quantization)
  path = check_output(output)
  try:
    spec.validate()
  except ValueError as e:
    raise RunError(f"the CTranslate2 spec is incomplete: {' '.join(str(e).split())}") from None
  if quantization in ("bfloat16", "int8_bfloat16"):
    try:
      import torch  # noqa: F401 - CTranslate2 converts to bfloat16 with it when present
    except ImportError:
      _bfloat16_without_torch(spec, quantization)
  spec.optimize(quantization=quantization)
  try:
    path.mkdir(parents=True, exist_ok=True)
    spec.save(str(path))
  except OSError as e:
    raise RunError(f"{output}: cannot write the model: {e.strerror or e}") from None
  return path


def export(workdir, output, checkpoint: str = "latest", quantization: str | None = None):
  """Writes the Transformer of `workdir` (its `checkpoint`: 'latest', a step or 'average:<k>';
  as decode.py restores it) as a CTranslate2 model directory `output`, weights stored as
  `quantization` (None: float32). Returns the directory's path."""
  checkpoint = str(checkpoint)
  if checkpoint.startswith("ensemble:"):
    raise ArgumentError(
      "checkpoint",
      checkpoint,
      "CTranslate2 runs one model; export one checkpoint, or the mean of the last k with "
      "average:<k>",
    )
  _check_quantization(quantization)
  check_output(output)
  restored = load_for_inference(workdir, checkpoint)
  spec = transformer_spec(restored.config.model, restored.params, Pieces(restored.vocab).pieces)
  path = write_model(spec, output, quantization)
  restored.vocab.save(path / workdir_name(restored.vocab))  # text in and out with the model alone
  limits = {"max_len": int(restored.config.model.max_len)}  # sources cut as decode.py cuts them
  (path / LIMITS_NAME).write_text(json.dumps(limits) + "\n")
  logging.info(
    "wrote %s: step %d (%s), %s", path, restored.step, checkpoint, quantization or "float32"
  )
  return path
