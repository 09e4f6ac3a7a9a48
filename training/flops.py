"""Analytic model FLOPs of a training step (matrix products only), for MFU.

Conventions (as in the PaLM paper's MFU, appendix B):
  * A product of an [m, k] and a [k, n] matrix costs 2·m·k·n FLOPs (one multiply, one add).
  * Only matrix products count: biases, LayerNorm, softmax, dropout, the loss and the optimizer
    are left out, and so are embedding lookups (a gather, not a product).
  * A weight matrix of P parameters applied to N tokens costs 2·P·N.
  * Each attention adds its two products, Q Kᵀ and A V, over all heads:
    2 · 2 · batch · q_len · kv_len · d_model (d_model = heads · d_k). Causal and padding masks
    do not reduce it: the whole q_len × kv_len block is computed.
  * Backward costs twice the forward (a gradient for the activations and one for the weights),
    so a training step is 3 × forward. Recomputation (`model.remat`) is not counted: it is not
    model work.

Encoder-decoder ('transformer'), with d = d_model, f = d_ff, V = vocab, B = batch,
S = source tokens and T = target tokens per row, per layer:
  encoder:  self-attention  2·4d²·B·S + 2·2·B·S·S·d;   feed-forward 2·2·d·f·B·S
  decoder:  self-attention  2·4d²·B·T + 2·2·B·T·T·d
            cross-attention 2·2d²·B·T (Q, output) + 2·2d²·B·S (K, V of the encoder output)
                            + 2·2·B·T·S·d
            feed-forward    2·2·d·f·B·T
and once: the output projection 2·d·V·B·T (target tokens only).

Decoder-only ('decoder_only'): one causal stack over L = S + T tokens per row (self-attention
and feed-forward as above with L), and the output projection over the T target tokens only
(model/decoder_only.py projects only the target part when training).

Recurrent ('rnn', 'rnn_attention'; model/rnn.py), with H = d_model, C = the encoder state width
(2H bidirectional, else H), G = gates·H (GRU 3, LSTM 4), N layers, counted over every position
(the recurrences step over padding too):
  encoder, per layer and direction:  inputs 2·D·G·B·S (D = H in layer 0, else C)
                                     + recurrent state 2·H·G·B·S
  decoder:  initial state s_0 = tanh(W c)  2·C·(N·H)·B·T (computed at every target position:
                                           packed rows restart at each sentence)
            bottom layer inputs  2·H·G·B·T (embedded y_{t-1}) + 2·C·G·B·T (context c_t)
            upper layers' inputs (N−1)·2·H·G·B·T;  recurrent states N·2·H·G·B·T
            output layer tanh(W_o [s_t; y_{t-1}; c_t])  2·(2H + C)·H·B·T
  attention ('rnn_attention', Bahdanau), per decoder step over all S source states:
            keys U h_j 2·C·H·B·S (once), query W s_{t-1} 2·H·H·B·T,
            scores vᵀ tanh(...) 2·H·B·T·S, context Σ_j α_tj h_j 2·C·B·T·S
and the output projection 2·H·V·B·T.
"""

from __future__ import annotations

from typing import Any


def forward_breakdown(model_cfg: Any, batch: int, src_len: int, tgt_len: int) -> dict[str, int]:
  """Forward-pass matmul FLOPs by part, for `config.model` and a [batch, src_len] source /
  [batch, tgt_len] target batch. Raises ValueError for a model type without a formula."""
  kind = model_cfg.get("type", "transformer")
  b, s, t = int(batch), int(src_len), int(tgt_len)
  if kind in ("rnn", "rnn_attention"):
    return _recurrent_breakdown(model_cfg, kind == "rnn_attention", b, s, t)
  d, f, vocab = int(model_cfg["d_model"]), int(model_cfg["d_ff"]), int(model_cfg["vocab_size"])
  n = int(model_cfg["num_layers"])

  def projections(weights, tokens):  # weights: parameters of the matrices applied to `tokens`
    return 2 * weights * b * tokens

  def attention(q_len, kv_len):
    return 2 * 2 * b * q_len * kv_len * d

  if kind == "transformer":
    return {
      "encoder_projections": n * projections(4 * d * d, s),
      "encoder_attention": n * attention(s, s),
      "encoder_ffn": n * projections(2 * d * f, s),
      "decoder_projections": n
      * (
        projections(4 * d * d, t)  # self Q, K, V, output
        + projections(2 * d * d, t)  # cross Q, output
        + projections(2 * d * d, s)
      ),  # cross K, V (encoder output)
      "decoder_attention": n * (attention(t, t) + attention(t, s)),
      "decoder_ffn": n * projections(2 * d * f, t),
      "output_projection": projections(d * vocab, t),
    }
  if kind == "decoder_only":
    length = s + t
    return {
      "decoder_projections": n * projections(4 * d * d, length),
      "decoder_attention": n * attention(length, length),
      "decoder_ffn": n * projections(2 * d * f, length),
      "output_projection": projections(d * vocab, t),
    }
  raise ValueError(
    f"no FLOP formula for model.type={kind!r} (known: transformer, decoder_only, "
    f"rnn, rnn_attention)"
  )


def _recurrent_breakdown(model_cfg: Any, attention: bool, b: int, s: int, t: int) -> dict[str, int]:
  """The recurrent models' forward matmul FLOPs by part (see the module doc)."""
  h, vocab = int(model_cfg["d_model"]), int(model_cfg["vocab_size"])
  n = int(model_cfg["num_layers"])
  cell = model_cfg.get("rnn_cell", "gru")
  if cell not in ("gru", "lstm"):
    raise ValueError(f"no FLOP formula for model.rnn_cell={cell!r} (known: gru, lstm)")
  dirs = 2 if model_cfg.get("rnn_bidirectional", True) else 1
  c, g = dirs * h, {"gru": 3, "lstm": 4}[cell] * h
  encoder_inputs = sum(dirs * 2 * (h if i == 0 else c) * g * b * s for i in range(n))
  parts = {
    "encoder_input_projections": encoder_inputs,
    "encoder_recurrent": n * dirs * 2 * h * g * b * s,
    "decoder_initial_state": 2 * c * n * h * b * t,
    "decoder_input_projections": (2 * h * g + 2 * c * g + (n - 1) * 2 * h * g) * b * t,
    "decoder_recurrent": n * 2 * h * g * b * t,
    "decoder_output_layer": 2 * (2 * h + c) * h * b * t,
    "output_projection": 2 * h * vocab * b * t,
  }
  if attention:
    parts["attention_projections"] = 2 * c * h * b * s + 2 * h * h * b * t
    parts["attention"] = 2 * h * b * t * s + 2 * c * b * t * s
  return parts


def forward_flops(model_cfg: Any, batch: int, src_len: int, tgt_len: int) -> int:
  """Matmul FLOPs of one forward pass (see the module doc)."""
  return sum(forward_breakdown(model_cfg, batch, src_len, tgt_len).values())


def train_flops(model_cfg: Any, batch: int, src_len: int, tgt_len: int) -> int:
  """Matmul FLOPs of one training step: forward + backward = 3 × forward."""
  return 3 * forward_flops(model_cfg, batch, src_len, tgt_len)
