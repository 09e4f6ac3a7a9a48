"""Attention weights of a trained model for plotting (inference/attention_plot.py draws them): one
sentence pair teacher-forced through the model, its sown encoder-decoder weights collected.

    weights = attention_weights(model, params, source_ids, output_ids)  # [layers, heads, tgt, src]
"""

from __future__ import annotations

import re

import jax
import numpy as np

from model.generate import strip
from model.special_tokens import EOS_ID, PAD_ID


def _natural_key(path):
  return [tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", str(k))) for k in path]


def _weights_fn(model):
  """The jitted (params, inputs, targets) -> sown intermediates of `model`."""

  def forward(mdl, src, tgt):
    return mdl.decode(mdl.encode(src), src, tgt, return_weights=True)

  def run(params, src, tgt):
    _, state = model.apply({"params": params}, src, tgt, method=forward, mutable=["intermediates"])
    return state["intermediates"]

  return jax.jit(run)


def attention_weights(model, params, inputs, output_ids) -> np.ndarray:
  """Encoder-decoder attention of one sentence pair, for plotting.

  Args:
    inputs: [src_len] source ids ending in EOS (PAD dropped).
    output_ids: [length] its translation, read up to the first EOS; EOS is appended when
      missing, so the last target row is the EOS position.

  Returns:
    [layers, heads, tgt_len, src_len] float32 weights (each row sums to 1 over the source).
  """
  from flax import traverse_util  # with the model's own Flax: not imported by decoding alone

  src = np.asarray(inputs).reshape(-1)
  src = src[src != PAD_ID]
  tgt = np.append(strip(output_ids), EOS_ID)
  flat = traverse_util.flatten_dict(
    _weights_fn(model)(params, src[None].astype(np.int32), tgt[None].astype(np.int32))
  )
  found = sorted(
    (path for path in flat if path[-1] == "attention_weights" and "cross_attention" in path),
    key=_natural_key,
  )
  if not found:
    name = getattr(model, "kind", None) or type(model).__name__
    raise ValueError(f"attention_weights: {name} sowed no cross-attention weights")
  return np.stack([np.asarray(flat[p][0][0], np.float32) for p in found])
