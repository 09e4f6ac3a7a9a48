"""Translation with a trained model: encode once, then greedy, sampled or beam search.

    ids = translate(model, params, inputs, beam_size=4)   # [batch, max_decode_len]
    outs = translate_all(model, params, token_lists)      # any number of sentences, input order
    ids = translate(model, stacked, inputs, ensemble=True)  # members' params on a leading axis

`model` is any module made by `model.build.build_model` (it offers `encode`, `init_cache`,
`decode_step`); model/decoder_state.py turns it into the step function and cache that the
searches of model/search.py run on. Source rows are token ids ending in EOS, padded with 0. Output
rows hold the generated tokens up to and including EOS, then PAD; a row cut by `max_decode_len`
has no EOS.
The decoder never emits PAD (its logit is masked), so PAD only ever means "after EOS".

Each distinct (model, input shape, search settings) is compiled once: parameters are an
argument of the compiled function, never constants baked into it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from model import search
from model.batching import length_batches
from model.decoder_state import DECODE_SEGMENT, decoder_state, ensemble_decoder_state
from model.special_tokens import EOS_ID, PAD_ID


def position_limit(model) -> int | None:
  """The longest target a model can place, or None. A model type with learned position tables
  declares `positional_limit = True` and gets `config.max_len`; the Transformer's sinusoidal
  positions have no limit."""
  if getattr(model, "positional_limit", False):
    return int(model.config.max_len)
  return None


_COMPILED: dict[tuple, Callable] = {}  # static settings -> jitted (params, inputs, rng) -> ids


def _only_ids_below(step, num_ids: int):
  """step_fn whose logits for ids >= num_ids (output rows the vocabulary has no piece for) are
  -inf, so no search can emit them."""

  def masked(ids, cache):
    logits, cache = step(ids, cache)
    return logits.at[:, num_ids:].set(-jnp.inf), cache

  return masked


def _translate_fn(
  model,
  beam_size: int,
  alpha: float,
  penalty: str,
  max_extra_len: int,
  max_decode_len: int,
  temperature: float,
  top_k: int,
  use_cache: bool,
  segment: int | None,
  num_ids: int | None,
  ensemble: bool,
):
  """The jitted `(params, inputs, rng) -> ids` for one set of static settings (made once)."""
  key = (
    model,
    beam_size,
    alpha,
    penalty,
    max_extra_len,
    max_decode_len,
    temperature,
    top_k,
    use_cache,
    segment,
    num_ids,
    ensemble,
  )
  if key not in _COMPILED:
    _COMPILED[key] = jax.jit(_make_run(*key))
  return _COMPILED[key]


def _make_run(
  model,
  beam_size,
  alpha,
  penalty,
  max_extra_len,
  max_decode_len,
  temperature,
  top_k,
  use_cache,
  segment,
  num_ids,
  ensemble,
):

  def run(params, inputs, rng):
    batch = inputs.shape[0]
    max_lens = jnp.sum(inputs != PAD_ID, axis=1, dtype=jnp.int32) + max_extra_len
    if ensemble:
      step, cache, grow, seg = ensemble_decoder_state(
        model, params, inputs, max_decode_len, segment
      )
    else:
      step, cache, grow, seg = decoder_state(
        model, params, inputs, max_decode_len, use_cache, segment
      )
    if num_ids is not None:
      step = _only_ids_below(step, num_ids)
    if temperature > 0:
      return search.sample(
        step,
        cache,
        rng,
        batch,
        max_decode_len,
        temperature=temperature,
        top_k=top_k,
        max_lens=max_lens,
        grow=grow,
        segment=seg,
      )
    if beam_size == 1:
      return search.greedy_search(
        step, cache, batch, max_decode_len, max_lens=max_lens, grow=grow, segment=seg
      )
    ids, _ = search.beam_search(
      step,
      cache,
      batch,
      max_decode_len,
      beam_size=beam_size,
      alpha=alpha,
      penalty=penalty,
      max_lens=max_lens,
      grow=grow,
      segment=seg,
    )
    return ids[:, 0]

  return run


def translate(
  model,
  params,
  inputs,
  *,
  beam_size: int = 4,
  alpha: float = 0.6,
  penalty: str = "gnmt",
  max_extra_len: int = 50,
  max_decode_len: int | None = None,
  rng=None,
  temperature: float = 0.0,
  top_k: int = 0,
  use_cache: bool = True,
  segment: int | None = DECODE_SEGMENT,
  num_ids: int | None = None,
  ensemble: bool = False,
) -> jax.Array:
  """Best translation of each source row.

  Args:
    model: a module from `model.build.build_model`; params: its (unboxed) parameters, or with
      `ensemble` several members' parameters stacked on a leading axis (same architecture),
      decoded as one model by the mean of their next-token probabilities
      (`ensemble_decoder_state`); an ensemble needs `use_cache`.
    inputs: [batch, src_len] source ids ending in EOS, 0 on padding.
    beam_size: 1 = greedy search; more = beam search with length penalty exponent `alpha`, of
      the form `penalty` ('gnmt', the paper's, or 'fairseq': see `search.beam_search`).
    max_extra_len: a sentence's output has at most (its source tokens + this) tokens, EOS
      included (the last one forced to EOS).
    max_decode_len: static output width; default src_len + max_extra_len (capped by
      `position_limit(model)`). Rows reaching it stop without EOS.
    rng, temperature, top_k: temperature > 0 samples (from the top_k tokens when top_k > 0)
      instead of searching; rng defaults to `jax.random.key(0)`.
    use_cache: False re-runs the full model on the prefix every step (same output, slower).
    segment: self-attention caches start at this many positions and grow, doubling (None:
      allocate `max_decode_len` at once); same output, faster for long outputs
      (`decoder_state`).
    num_ids: only ids below this are emitted (pass the vocabulary's size: when model.vocab_size
      is larger, the extra output rows have no piece to decode to); None = every id.

  Returns:
    ids [batch, max_decode_len] int32: tokens up to EOS, then PAD.
  """
  inputs = jnp.asarray(inputs, jnp.int32)
  if inputs.ndim != 2:
    raise ValueError(f"translate: inputs must be [batch, src_len] ids, got shape {inputs.shape}")
  if beam_size < 1 or max_extra_len < 0 or temperature < 0 or top_k < 0:
    raise ValueError(
      f"translate: need beam_size >= 1, max_extra_len >= 0, temperature >= 0 and "
      f"top_k >= 0; got {beam_size}, {max_extra_len}, {temperature}, {top_k}"
    )
  if max_decode_len is None:
    max_decode_len = inputs.shape[1] + max_extra_len
  limit = position_limit(model)
  if limit is not None:
    max_decode_len = min(max_decode_len, limit)
  if max_decode_len < 1:
    raise ValueError(f"translate: max_decode_len must be positive, got {max_decode_len}")
  if num_ids is not None and not EOS_ID < num_ids:
    raise ValueError(f"translate: num_ids must exceed the EOS id {EOS_ID}, got {num_ids}")
  if segment is not None and segment < 1:
    raise ValueError(f"translate: segment must be positive or None, got {segment}")
  if penalty not in search.PENALTIES:
    raise ValueError(f"translate: penalty={penalty!r} is not one of {search.PENALTIES}")
  if ensemble and not use_cache:
    raise ValueError(
      "translate: an ensemble decodes with the key/value cache; use_cache=False "
      "is for single models"
    )
  sampling = temperature > 0
  # Settings that do not change the computation are normalised so they share one compilation.
  fn = _translate_fn(
    model,
    1 if sampling else int(beam_size),
    float(alpha) if beam_size > 1 and not sampling else 0.0,
    penalty if beam_size > 1 and not sampling else "gnmt",
    int(max_extra_len),
    int(max_decode_len),
    float(temperature),
    int(top_k) if sampling else 0,
    bool(use_cache),
    None if not use_cache or segment is None or segment >= max_decode_len else int(segment),
    None if num_ids is None or num_ids >= model.config.vocab_size else int(num_ids),
    bool(ensemble),
  )
  if rng is None:
    rng = jax.random.key(0)
  return fn(params, inputs, rng)


# ---------------------------------------------------------------------------------------------
# Many sentences: batches of similar length (model/batching.py).


def translate_all(
  model,
  params,
  token_lists: Sequence[Sequence[int]],
  *,
  tokens_per_batch: int = 4096,
  batch_multiple: int = 1,
  place: Callable | None = None,
  on_batch: Callable[[int], None] | None = None,
  **kwargs,
) -> list[np.ndarray]:
  """`translate` over any number of sentences, batched by `length_batches`.

  Args:
    token_lists: source ids of each sentence, each ending in EOS.
    tokens_per_batch: padded source tokens per batch (beam search multiplies the work by beam).
    batch_multiple: every batch's row count is a multiple of this (e.g. the devices it is split
      over).
    place: applied to each batch's [rows, length] ids before decoding (e.g. `jax.device_put`
      with a sharding); None leaves them as numpy.
    on_batch: called after each batch with the number of sentences done so far.
    **kwargs: passed to `translate` (beam_size, alpha, max_extra_len, ...); `rng` (default
      `jax.random.key(0)`) is folded with the batch's number, so batches of the same shape
      sample independently.

  Returns:
    per sentence, in input order: its translation's ids [tokens] (no EOS, no PAD).
  """
  outputs: list[np.ndarray | None] = [None] * len(token_lists)
  rng = kwargs.pop("rng", None)
  rng = jax.random.key(0) if rng is None else rng
  done = 0
  for n, batch in enumerate(length_batches(token_lists, tokens_per_batch, batch_multiple)):
    kwargs["rng"] = jax.random.fold_in(rng, n)
    inputs = batch.inputs if place is None else place(batch.inputs)
    ids = np.asarray(translate(model, params, inputs, **kwargs))
    for row, i in enumerate(batch.indices):
      outputs[i] = strip(ids[row])
    done += len(batch.indices)
    if on_batch is not None:
      on_batch(done)
  return outputs


def strip(ids) -> np.ndarray:
  """[length] ids -> the tokens before the first EOS, PAD dropped."""
  ids = np.asarray(ids).reshape(-1)
  eos = np.flatnonzero(ids == EOS_ID)
  if len(eos):
    ids = ids[: eos[0]]
  return ids[ids != PAD_ID]


# ---------------------------------------------------------------------------------------------
# Attention weights for plotting.


def _natural_key(path):
  return [tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", str(k))) for k in path]


_WEIGHTS: dict = {}  # model -> jitted (params, inputs, targets) -> sown intermediates


def _make_weights(model):
  def forward(mdl, src, tgt):
    return mdl.decode(mdl.encode(src), src, tgt, return_weights=True)

  def run(params, src, tgt):
    _, state = model.apply({"params": params}, src, tgt, method=forward, mutable=["intermediates"])
    return state["intermediates"]

  return run


def attention_weights(model, params, inputs, output_ids) -> np.ndarray:
  """Encoder-decoder attention of one sentence pair, for plotting.

  Args:
    inputs: [src_len] source ids ending in EOS (PAD dropped).
    output_ids: [length] its translation, read up to the first EOS; EOS is appended when
      missing, so the last target row is the EOS position.

  Returns:
    [layers, heads, tgt_len, src_len] float32 weights (each row sums to 1 over the source).
  """
  src = np.asarray(inputs).reshape(-1)
  src = src[src != PAD_ID]
  tgt = np.append(strip(output_ids), EOS_ID)
  if model not in _WEIGHTS:
    _WEIGHTS[model] = jax.jit(_make_weights(model))
  flat = traverse_util.flatten_dict(
    _WEIGHTS[model](params, src[None].astype(np.int32), tgt[None].astype(np.int32))
  )
  found = sorted(
    (path for path in flat if path[-1] == "attention_weights" and "cross_attention" in path),
    key=_natural_key,
  )
  if not found:
    raise ValueError(f"attention_weights: {type(model).__name__} sowed no cross-attention weights")
  return np.stack([np.asarray(flat[p][0][0], np.float32) for p in found])
