"""Recurrent encoder-decoders with the Transformer's interface (see model/build.py).

    logits = RNNSeq2Seq(cfg).apply({'params': p}, inputs, targets)   # [batch, tgt_len, vocab]

* `attention=False` (`model.type='rnn'`): the context-vector model (Sutskever et al. 2014;
  Cho et al. 2014). The encoder's final state c (forward state at the last token, concatenated
  with the backward state at the first token when bidirectional) starts the decoder
  (s_0 = tanh(W c)) and is fed to the decoder input and to the output layer at every step.
* `attention=True` (`model.type='rnn_attention'`): the same encoder and initial state, plus additive
  attention (Bahdanau et al. 2015) over all encoder states at every step:
  e_tj = vᵀ tanh(W s_{t-1} + U h_j), α = softmax over the sentence's tokens, c_t = Σ_j α_tj h_j.

Each decoder step: GRU/LSTM stack over [y_{t-1}; c_t] (c_t feeds the bottom layer), then
logits = Out(tanh(W_o [s_t; y_{t-1}; c_t])), with Out the shared embedding (`share_embeddings`) or a
Dense layer. The recurrences run in `lax.scan` (both encoder directions in one scan); input
projections are computed for all steps at once outside it. Parameters are float32; matmuls
run in `dtype`; the recurrent state is float32.

Padding (id 0) is skipped: the state is carried unchanged across it, so a sentence's final state
is the state at its last real token, and the backward direction starts at it. Packed rows are
supported: at every segment start (forward) or end (backward) the state resets, each target segment
gets the context of its own source segment, attention only sees its own segment, and the decoder
restarts from that segment's initial state. Positions are not used (recurrence orders the tokens).
The LSTM's memory cell starts at zero (its hidden state from the context, as the GRU's).

One module for both models: they share encoder, cells and decoder, and the decoder's
teacher-forced scan and its one-position decode step mirror each other line for line, so they
are kept side by side. Their hyperparameters are model/config.py's `RNNConfig`.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import initializers
from jax import lax

from model import cache_kinds
from model.config import RNNConfig
from model.dropout import Dropout, keep_mask
from model.layers import Embed
from model.stored_params import StoredParams
from model.transformer import check_tokens, shift_right

_GATES = {"gru": 3, "lstm": 4}


# ----------------------------------------------------------------------------- pure helpers
def _kernel_init(names, init=initializers.xavier_uniform()):
  return nn.with_logical_partitioning(init, names)


def _gate_bias_init(cell: str, names=("mlp",)):
  """Zeros, except 1 on the LSTM forget gate (so the cell remembers at the start of training)."""

  def init(key, shape, dtype=jnp.float32):
    bias = jnp.zeros(shape, dtype)
    if cell == "lstm":
      hidden = shape[-1] // 4
      bias = bias.at[..., hidden : 2 * hidden].set(1.0)
    return bias

  return nn.with_logical_partitioning(init, names)


def _cell_update(cell: str, carry, xw, hw):
  """One GRU/LSTM update.

  carry: (h,) for GRU or (h, c) for LSTM, each [..., H] float32; xw: [..., G*H] the input's
  projection and hw: [..., G*H] the recurrent one (U h + b), each with its bias.
  """
  xw = xw.astype(jnp.float32)
  if cell == "gru":  # Cho et al. 2014; the reset gate multiplies U_n h + b_n (as cuDNN / Flax)
    xr, xz, xn = jnp.split(xw, 3, axis=-1)
    hr, hz, hn = jnp.split(hw, 3, axis=-1)
    r = jax.nn.sigmoid(xr + hr)
    z = jax.nn.sigmoid(xz + hz)
    n = jnp.tanh(xn + r * hn)
    return ((1.0 - z) * n + z * carry[0],)
  i, f, g, o = jnp.split(xw + hw, 4, axis=-1)
  c = jax.nn.sigmoid(f) * carry[1] + jax.nn.sigmoid(i) * jnp.tanh(g)
  return (jax.nn.sigmoid(o) * jnp.tanh(c), c)


def _select(cond, a, b):
  """`where(cond, a, b)` over two carries; cond has the carries' leading dims ([batch] or
  [directions, batch])."""
  return jax.tree_util.tree_map(
    lambda x, y: jnp.where(cond.reshape(cond.shape + (1,) * (x.ndim - cond.ndim)), x, y), a, b
  )


def _run_starts(seg):
  """[batch, length] segment ids -> True at the first position of every run of equal ids."""
  return seg != jnp.pad(seg, ((0, 0), (1, 0)), constant_values=-1)[:, :-1]


def _run_ends(seg):
  """[batch, length] segment ids -> True at the last position of every run of equal ids."""
  return seg != jnp.pad(seg, ((0, 0), (0, 1)), constant_values=-1)[:, 1:]


def _segments(tokens, segmentation):
  """The given segment ids, or 1 everywhere (one sentence per row, padding skipped)."""
  if segmentation is None:
    return jnp.ones(tokens.shape, jnp.int32)
  return segmentation.astype(jnp.int32)


def _gather_rows(x, index):
  """x: [batch, src_len, C], index: [batch, tgt_len] -> [batch, tgt_len, C]."""
  return jnp.take_along_axis(x, index[:, :, None], axis=1)


def sentence_context(states, src_seg, tgt_seg, d_model: int, bidirectional: bool):
  """The context vector of each target position's sentence.

  states: [batch, src_len, C] top-layer encoder states ([forward; backward]); src_seg:
  [batch, src_len] and tgt_seg: [batch, tgt_len] segment ids. Returns [batch, tgt_len, C]: the
  forward state at the segment's last source position and the backward state at its first
  (exact gathers, no arithmetic). A target segment without a source gets zeros.
  """
  match = tgt_seg[:, :, None] == src_seg[:, None, :]  # [batch, tgt_len, src_len]
  ends = match & (_run_ends(src_seg) & (src_seg > 0))[:, None, :]
  out = _gather_rows(states[..., :d_model], jnp.argmax(ends, axis=-1))
  found = jnp.any(ends, axis=-1)
  if bidirectional:
    starts = match & (_run_starts(src_seg) & (src_seg > 0))[:, None, :]
    back = _gather_rows(states[..., d_model:], jnp.argmax(starts, axis=-1))
    out = jnp.concatenate([out, back], axis=-1)
  return jnp.where(found[..., None], out, 0.0)


def _time_major(x):
  return None if x is None else jnp.swapaxes(x, 0, 1)


# ----------------------------------------------------------------------------- modules
class RNNLayer(StoredParams):
  """One GRU/LSTM layer over whole rows; when bidirectional, both directions run in one scan
  (parameters stacked on a leading direction axis, the backward one on time-reversed rows)."""

  cell: str
  hidden: int
  bidirectional: bool = False
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, segments, valid):
    """x: [batch, length, d_in]; segments: [batch, length] ids; valid: [batch, length] bool.
    Returns [batch, length, H] (forward) or [batch, length, 2H] ([forward; backward]): the
    state after reading each position, carried unchanged over padding.

    Each direction restarts from zero at the first token of every segment it meets.
    """
    dirs, gates, dt = 2 if self.bidirectional else 1, _GATES[self.cell] * self.hidden, self.dtype
    w = self.param(
      "input_kernel",
      _kernel_init(
        (None, "embed", "mlp"), initializers.xavier_uniform(in_axis=-2, out_axis=-1, batch_axis=0)
      ),
      (dirs, x.shape[-1], gates),
      jnp.float32,
    )
    bw = self.param(
      "input_bias", _gate_bias_init(self.cell, (None, "mlp")), (dirs, gates), jnp.float32
    )
    u = self.param(
      "recurrent_kernel",
      _kernel_init((None, "embed", "mlp"), initializers.orthogonal()),
      (dirs, self.hidden, gates),
      jnp.float32,
    ).astype(dt)
    bu = self.param(
      "recurrent_bias",
      nn.with_logical_partitioning(initializers.zeros, (None, "mlp")),
      (dirs, gates),
      jnp.float32,
    )
    xw = jnp.einsum("bld,kdg->lkbg", x.astype(dt), w.astype(dt)) + bw[:, None].astype(dt)
    reset, valid = _time_major(_run_starts(segments))[:, None], _time_major(valid)[:, None]
    if self.bidirectional:  # reversed, a segment's last token comes first
      flip = lambda a: jnp.concatenate([a[:, :1], a[::-1, 1:]], axis=1)
      xw = flip(xw)
      reset = jnp.concatenate([reset, _time_major(_run_ends(segments))[::-1, None]], axis=1)
      valid = flip(jnp.concatenate([valid, valid], axis=1))
    zeros = jnp.zeros((dirs, x.shape[0], self.hidden), jnp.float32)
    zero = (zeros,) * (2 if self.cell == "lstm" else 1)

    def body(carry, xs):
      xw_t, reset_t, valid_t = xs
      carry = _select(reset_t, zero, carry)
      hw = (
        jnp.einsum("kbh,khg->kbg", carry[0].astype(dt), u, preferred_element_type=jnp.float32)
        + bu[:, None]
      )
      carry = _select(valid_t, _cell_update(self.cell, carry, xw_t, hw), carry)
      return carry, carry[0]

    _, hs = lax.scan(body, zero, (xw, reset, valid))  # [length, dirs, batch, H]
    outs = [hs[:, 0]] + ([hs[::-1, 1]] if self.bidirectional else [])
    return _time_major(jnp.concatenate(outs, axis=-1)).astype(dt)


class RNNEncoder(nn.Module):
  """Embedding, dropout, `num_layers` (bi)directional recurrent layers with dropout between."""

  config: RNNConfig
  embed: Embed

  @nn.compact
  def __call__(self, inputs, segments, deterministic):
    """inputs: [batch, src_len] ids; segments: [batch, src_len] ids (1 everywhere when unpacked).
    Returns the top layer's states [batch, src_len, C] ([forward; backward] when bidirectional)."""
    cfg = self.config
    x = Dropout(cfg.dropout_rate)(self.embed(inputs), deterministic=deterministic)
    for i in range(cfg.num_layers):
      if i:
        x = Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
      x = RNNLayer(
        cfg.rnn_cell, cfg.d_model, cfg.rnn_bidirectional, cfg.compute_dtype, name=f"layer_{i}"
      )(x, segments, inputs > 0)
    return x


class RNNDecoder(StoredParams):
  """The conditional recurrent decoder; one step function serves teacher forcing (in `lax.scan`)
  and incremental decoding, so both compute the same thing."""

  config: RNNConfig
  embed: Embed
  attention: bool = False

  def setup(self):
    cfg = self.config
    h, gates, dt = cfg.d_model, _GATES[cfg.rnn_cell] * cfg.d_model, cfg.compute_dtype
    dense = dict(
      dtype=dt,
      param_dtype=jnp.float32,
      bias_init=nn.with_logical_partitioning(initializers.zeros, ("embed",)),
    )
    kernel = lambda name, shape, init=_kernel_init(("embed", "mlp")): self.param(
      name, init, shape, jnp.float32
    )
    self.initial = nn.Dense(
      cfg.num_layers * h, kernel_init=_kernel_init(("mlp", "embed")), **dense, name="initial"
    )
    self.input = nn.Dense(
      gates,
      dtype=dt,
      param_dtype=jnp.float32,
      kernel_init=_kernel_init(("embed", "mlp")),
      bias_init=_gate_bias_init(cfg.rnn_cell),
      name="input",
    )
    self.context_kernel = kernel("context_kernel", (cfg.context_size, gates))
    self.layer_kernels = [
      kernel(f"layer_{i}_input_kernel", (h, gates)) for i in range(1, cfg.num_layers)
    ]
    self.layer_biases = [
      self.param(f"layer_{i}_input_bias", _gate_bias_init(cfg.rnn_cell), (gates,), jnp.float32)
      for i in range(1, cfg.num_layers)
    ]
    self.recurrent_kernels = [
      kernel(
        f"layer_{i}_recurrent_kernel",
        (h, gates),
        _kernel_init(("embed", "mlp"), initializers.orthogonal()),
      )
      for i in range(cfg.num_layers)
    ]
    self.recurrent_biases = [
      self.param(
        f"layer_{i}_recurrent_bias",
        nn.with_logical_partitioning(initializers.zeros, ("mlp",)),
        (gates,),
        jnp.float32,
      )
      for i in range(cfg.num_layers)
    ]
    if self.attention:
      self.attention_keys = nn.Dense(
        h,
        dtype=dt,
        param_dtype=jnp.float32,
        kernel_init=_kernel_init(("embed", "mlp")),
        bias_init=nn.with_logical_partitioning(initializers.zeros, ("mlp",)),
        name="attention_keys",
      )
      self.attention_query = kernel("attention_query", (h, h))
      self.attention_v = self.param(
        "attention_v",
        nn.with_logical_partitioning(initializers.normal(h**-0.5), ("mlp",)),
        (h,),
        jnp.float32,
      )
    self.output = nn.Dense(h, kernel_init=_kernel_init(("mlp", "embed")), **dense, name="output")
    if not cfg.share_embeddings:
      self.logits = nn.Dense(
        cfg.vocab_size,
        dtype=dt,
        param_dtype=jnp.float32,
        kernel_init=_kernel_init(("embed", "vocab")),
        bias_init=nn.with_logical_partitioning(initializers.zeros, ("vocab",)),
        name="logits",
      )
    self.dropout = Dropout(cfg.dropout_rate)

  def initial_carry(self, context):
    """context: [..., C] -> the decoder state s_0 = tanh(W c): (h,) or (h, c), each
    [..., num_layers, H] float32 (the LSTM memory cell starts at zero)."""
    cfg = self.config
    h = jnp.tanh(self.initial(context).astype(jnp.float32))
    h = h.reshape(*context.shape[:-1], cfg.num_layers, cfg.d_model)
    return (h, jnp.zeros_like(h)) if cfg.rnn_cell == "lstm" else (h,)

  def memory(self, states, src_seg):
    """What attention reads: (states [batch, src_len, C], keys U h_j [batch, src_len, H],
    segment ids [batch, src_len] with -1 on padding); None for the context-vector model."""
    if not self.attention:
      return None
    return states, self.attention_keys(states), src_seg

  def _step_fn(self, memory):
    """The pure step `(carry, xs) -> (carry, (s_t [batch, H], c_t [batch, C]))`.

    xs: 'x' [batch, G*H] the embedded previous token's projection; 'reset' [batch] and 'init'
    (a carry) restart the state at segment starts; 'context' [batch, C] the sentence's context
    (context model) or 'segment' [batch] the sentence to attend to (attention); 'drop'
    [batch, num_layers-1, H] or None, dropout masks between layers.
    """
    cfg, dt = self.config, self.config.compute_dtype
    wc = self.context_kernel.astype(dt)
    w_in = [k.astype(dt) for k in self.layer_kernels]
    b_in = list(self.layer_biases)
    u = [k.astype(dt) for k in self.recurrent_kernels]
    b = list(self.recurrent_biases)
    if memory is not None:
      states, keys, src_seg = memory
      wq, v = self.attention_query.astype(dt), self.attention_v.astype(dt)

    def step(carry, xs):
      carry = _select(xs["reset"], xs["init"], carry)
      if memory is None:
        context = xs["context"]
      else:
        query = jnp.dot(carry[0][:, -1].astype(dt), wq)  # s_{t-1}: the top layer's state
        hidden = jnp.tanh(keys + query[:, None, :].astype(keys.dtype))
        scores = jnp.dot(hidden, v, preferred_element_type=jnp.float32)  # [batch, src_len]
        mask = src_seg == xs["segment"][:, None]
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(scores, axis=-1)
        weights = jnp.where(jnp.any(mask, axis=-1, keepdims=True), weights, 0.0)
        context = jnp.einsum("bs,bsc->bc", weights.astype(states.dtype), states)
      x = xs["x"].astype(jnp.float32) + jnp.dot(
        context.astype(dt), wc, preferred_element_type=jnp.float32
      )
      new = []
      for i in range(cfg.num_layers):
        if i:
          below = new[-1][0]
          if xs["drop"] is not None:
            below = below * xs["drop"][:, i - 1]
          x = (
            jnp.dot(below.astype(dt), w_in[i - 1], preferred_element_type=jnp.float32) + b_in[i - 1]
          )
        state = tuple(c[:, i] for c in carry)
        hw = jnp.dot(state[0].astype(dt), u[i], preferred_element_type=jnp.float32) + b[i]
        new.append(_cell_update(cfg.rnn_cell, state, x, hw))
      carry = tuple(jnp.stack(parts, axis=1) for parts in zip(*new))
      return carry, (carry[0][:, -1], context)

    return step

  def _logits(self, s, y, context, deterministic):
    """s: [batch, len, H], y: [batch, len, d_model], context: [batch, len, C] -> logits."""
    dt = self.config.compute_dtype
    o = jnp.tanh(self.output(jnp.concatenate([s.astype(dt), y, context.astype(dt)], axis=-1)))
    o = self.dropout(o, deterministic=deterministic)
    return self.embed.attend(o) if self.config.share_embeddings else self.logits(o)

  def _embed(self, ids, deterministic):
    y = self.dropout(self.embed(ids), deterministic=deterministic)
    return y, self.input(y)

  def __call__(self, decoder_inputs, tgt_seg, context, memory, deterministic):
    """Teacher forcing over whole rows.

    decoder_inputs: [batch, tgt_len] ids (shifted right); tgt_seg: [batch, tgt_len] segment ids;
    context: [batch, tgt_len, C] each position's sentence context; memory: see `memory`.
    Returns [batch, tgt_len, vocab] logits.
    """
    cfg = self.config
    y, x = self._embed(decoder_inputs, deterministic)
    batch, length = decoder_inputs.shape
    drop = None
    if not deterministic and cfg.dropout_rate > 0 and cfg.num_layers > 1:
      keep = keep_mask(
        self.make_rng("dropout"), cfg.dropout_rate, (batch, length, cfg.num_layers - 1, cfg.d_model)
      )
      drop = keep.astype(jnp.float32) / (1.0 - cfg.dropout_rate)
    xs = {"x": x, "reset": _run_starts(tgt_seg), "init": self.initial_carry(context), "drop": drop}
    if memory is None:
      xs["context"] = context
    else:
      xs["segment"] = tgt_seg
    xs = jax.tree_util.tree_map(_time_major, xs)
    carry = jax.tree_util.tree_map(lambda c: jnp.zeros_like(c[0]), xs["init"])
    _, (s, ctx) = lax.scan(self._step_fn(memory), carry, xs)
    return self._logits(_time_major(s), y, _time_major(ctx), deterministic)

  def step(self, ids, carry, context, memory):
    """One incremental step. ids: [batch, 1]; carry: the state; context: [batch, C] (context
    model, else None). Returns ([batch, vocab] logits, new carry)."""
    y, x = self._embed(ids, True)
    batch = ids.shape[0]
    xs = {"x": x[:, 0], "reset": jnp.zeros((batch,), bool), "init": carry, "drop": None}
    if memory is None:
      xs["context"] = context
    else:
      xs["segment"] = jnp.ones((batch,), jnp.int32)
    carry, (s, ctx) = self._step_fn(memory)(carry, xs)
    return self._logits(s[:, None], y, ctx[:, None], True)[:, 0], carry


class RNNSeq2Seq(nn.Module):
  """Recurrent encoder-decoder: the context-vector model, or with `attention` Bahdanau's.
  Source and target share one embedding when `share_embeddings` (also the output projection)."""

  config: RNNConfig
  attention: bool = False

  @property
  def kind(self) -> str:
    """model.type (model/build.py)."""
    return "rnn_attention" if self.attention else "rnn"

  def setup(self):
    cfg = self.config
    src_embed = Embed(cfg.vocab_size, cfg.d_model, cfg.compute_dtype, name="embed")
    tgt_embed = (
      src_embed
      if cfg.share_embeddings
      else Embed(cfg.vocab_size, cfg.d_model, cfg.compute_dtype, name="target_embed")
    )
    self.encoder = RNNEncoder(cfg, src_embed)
    self.decoder = RNNDecoder(cfg, tgt_embed, self.attention)

  def encode(self, inputs, inputs_position=None, inputs_segmentation=None, deterministic=True):
    """inputs: [batch, src_len] ids (0 = pad) -> states [batch, src_len, C] (positions unused)."""
    del inputs_position
    check_tokens("RNNSeq2Seq", "inputs", inputs)
    if inputs_segmentation is not None:
      check_tokens("RNNSeq2Seq", "inputs", inputs, inputs_segmentation, "inputs_segmentation")
    return self.encoder(inputs, _segments(inputs, inputs_segmentation), deterministic)

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
    del targets_position
    check_tokens("RNNSeq2Seq", "targets", targets)
    if targets.shape[0] != inputs.shape[0]:
      raise ValueError(
        f"RNNSeq2Seq: batch sizes differ: inputs {inputs.shape}, targets {targets.shape}"
      )
    if (inputs_segmentation is None) != (targets_segmentation is None):
      raise ValueError(
        "RNNSeq2Seq: give both inputs_segmentation and targets_segmentation, or neither"
      )
    if targets_segmentation is not None:
      check_tokens("RNNSeq2Seq", "targets", targets, targets_segmentation, "targets_segmentation")
    states = self.encode(inputs, inputs_position, inputs_segmentation, deterministic)
    src_seg = _segments(inputs, inputs_segmentation)
    tgt_seg = _segments(targets, targets_segmentation)
    context = sentence_context(
      states, src_seg, tgt_seg, self.config.d_model, self.config.rnn_bidirectional
    )
    memory = self.decoder.memory(states, jnp.where(inputs > 0, src_seg, -1))
    return self.decoder(
      shift_right(targets, targets_segmentation), tgt_seg, context, memory, deterministic
    )

  def init_cache(self, encoded, inputs, max_decode_len: int):
    """Creates the decoding state (call with `mutable=model.cache_kinds.COLLECTIONS`): the decoder
    state s_0 and the context (context model) or the encoder states, attention keys and source mask
    (attention). Every leaf is [batch, ...] and a `STATE` entry (each beam keeps its own copy).
    `max_decode_len` is unused (no length limit).

    encoded: [batch, src_len, C] from `encode` (one sentence per row); inputs: [batch, src_len].
    """
    del max_decode_len
    check_tokens("RNNSeq2Seq", "inputs", inputs)
    if encoded.ndim != 3 or encoded.shape[:2] != inputs.shape:
      raise ValueError(
        f"RNNSeq2Seq.init_cache: encoded {encoded.shape} must be "
        f"[batch, src_len, C] matching inputs {inputs.shape}"
      )
    cfg = self.config
    ones = jnp.ones((inputs.shape[0], 1), jnp.int32)
    context = sentence_context(
      encoded, _segments(inputs, None), ones, cfg.d_model, cfg.rnn_bidirectional
    )[:, 0]
    carry = self.decoder.initial_carry(context)
    self.put_variable(cache_kinds.STATE, "hidden", carry[0])
    if cfg.rnn_cell == "lstm":
      self.put_variable(cache_kinds.STATE, "cell", carry[1])
    if self.attention:
      states, keys, segments = self.decoder.memory(encoded, jnp.where(inputs > 0, 1, -1))
      self.put_variable(cache_kinds.STATE, "states", states)
      self.put_variable(cache_kinds.STATE, "keys", keys)
      self.put_variable(cache_kinds.STATE, "source_segments", segments)
    else:
      self.put_variable(cache_kinds.STATE, "context", context)

  def decode_step(self, ids):
    """One decoding step from the cache (call with `mutable=model.cache_kinds.CARRIED`).

    ids: [batch, 1], the previous target token (0 at the first step). Returns [batch, vocab].
    """
    if ids.ndim != 2 or ids.shape[1] != 1:
      raise ValueError(f"RNNSeq2Seq.decode_step: ids must be [batch, 1], got {ids.shape}")
    get = lambda name: self.get_variable(cache_kinds.STATE, name)
    carry = (get("hidden"),) + ((get("cell"),) if self.config.rnn_cell == "lstm" else ())
    if self.attention:
      memory, context = (get("states"), get("keys"), get("source_segments")), None
    else:
      memory, context = None, get("context")
    logits, carry = self.decoder.step(ids, carry, context, memory)
    self.put_variable(cache_kinds.STATE, "hidden", carry[0])
    if self.config.rnn_cell == "lstm":
      self.put_variable(cache_kinds.STATE, "cell", carry[1])
    return logits
