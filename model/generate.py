"""Translation with a trained model: encode once, then greedy, sampled or beam search.

    ids = translate(model, params, inputs, beam_size=4)   # [batch, max_decode_len]
    outs = translate_all(model, params, token_lists)      # any number of sentences, input order
    ids = translate(model, stacked, inputs, ensemble=True)  # members' params on a leading axis

`model` is any module made by `model.build.build_model` (it offers `encode`, `init_cache`,
`decode_step`). Source rows are token ids ending in EOS, padded with 0. Output rows hold the
generated tokens up to and including EOS, then PAD; a row cut by `max_decode_len` has no EOS.
The decoder never emits PAD (its logit is masked), so PAD only ever means "after EOS".

Each distinct (model, input shape, search settings) is compiled once: parameters are an
argument of the compiled function, never constants baked into it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from jax import lax

from model import search
from model.special_tokens import EOS_ID, PAD_ID

MIN_BUCKET = 8


def position_limit(model) -> int | None:
  """The longest target a model can place, or None. A model type with learned position tables
  declares `positional_limit = True` and gets `config.max_len`; the Transformer's sinusoidal
  positions have no limit."""
  if getattr(model, "positional_limit", False):
    return int(model.config.max_len)
  return None


def _mask_pad(logits):
  """[n, vocab] -> float32 logits with PAD impossible."""
  return logits.astype(jnp.float32).at[:, PAD_ID].set(-jnp.inf)


def _is_per_sentence(path) -> bool:
  """Cache entries that are the same for every beam of a sentence (the projected source
  keys/values and mask of cross-attention): kept once per sentence, never expanded or reordered."""
  return str(path[-1]).startswith("cross_")


def _cached_step(model, params, per_sentence=None):
  """step_fn over the model's key/value cache: one decoder position per call. `per_sentence`
  holds the cache entries shared by all beams (closed over, so search neither copies them per
  beam nor reorders them each step); the search carries the rest."""
  per_sentence = per_sentence or {}

  def step(ids, cache):
    full = traverse_util.unflatten_dict({**traverse_util.flatten_dict(cache), **per_sentence})
    logits, state = model.apply(
      {"params": params, "cache": full}, ids, method="decode_step", mutable=["cache"]
    )
    carried = {
      k: v for k, v in traverse_util.flatten_dict(state["cache"]).items() if k not in per_sentence
    }
    return _mask_pad(logits), traverse_util.unflatten_dict(carried)

  return step


# Self-attention key/value buffers (model/layers.py): one slot per position on axis -2.
_GROWN = ("cached_key", "cached_value")
DECODE_SEGMENT = 16  # default: self-attention buffers grow 16 positions at a time


class DecoderState(NamedTuple):
  """What model/search.py's functions take: `step` and `cache` (the step function contract),
  and, for a cache whose self-attention buffers start at `segment` positions, the `grow`
  function that enlarges them (None: the cache is sized for the whole output)."""

  step: Callable
  cache: object
  grow: Callable | None = None
  segment: int | None = None


def _grow(cache, extra: int):
  """The cache with `extra` more (zero) positions in every self-attention buffer."""
  flat = traverse_util.flatten_dict(cache)
  return traverse_util.unflatten_dict(
    {
      k: (jnp.pad(v, [(0, 0)] * (v.ndim - 2) + [(0, extra), (0, 0)]) if k[-1] in _GROWN else v)
      for k, v in flat.items()
    }
  )


def _initial_cache(model, params, inputs, length: int) -> dict:
  """Encodes `inputs` and returns the model's decoding cache for `length` target positions, as a
  flat {path: array} dict."""
  encoded = model.apply({"params": params}, inputs, method="encode")
  _, state = model.apply(
    {"params": params}, encoded, inputs, length, method="init_cache", mutable=["cache"]
  )
  return traverse_util.flatten_dict(state["cache"])


def _cache_length(model, params, inputs, max_decode_len: int, segment: int | None):
  """(positions the cache starts with, whether its self-attention buffers grow): `segment`
  positions when the cache has buffers to grow, else `max_decode_len` (recurrent state)."""
  first = max_decode_len if not segment or segment >= max_decode_len else int(segment)
  if first < max_decode_len:
    shapes = jax.eval_shape(lambda p: _initial_cache(model, p, inputs, first), params)
    if any(k[-1] in _GROWN for k in shapes):
      return first, True
  return max_decode_len, False


def decoder_state(
  model,
  params,
  inputs,
  max_decode_len: int,
  use_cache: bool = True,
  segment: int | None = DECODE_SEGMENT,
) -> DecoderState:
  """The search's step function and cache for source rows `inputs` [batch, src_len]: with the
  key/value cache (encode once, then one position per step), or without (re-run the whole
  model on the prefix every step; the reference the cache is tested against).

  With `segment`, self-attention buffers start at `segment` positions and the search grows them
  a segment at a time (model/search.py), so early steps do not stream (or, in beam search,
  reorder) the empty rest of a `max_decode_len` buffer; None allocates all of it at once."""
  if not use_cache:
    cache = {
      "inputs": inputs,
      "targets": jnp.full((inputs.shape[0], max_decode_len), EOS_ID, jnp.int32),
      "t": jnp.int32(0),
    }
    return DecoderState(_uncached_step(model, params), cache)
  length, grows = _cache_length(model, params, inputs, max_decode_len, segment)
  flat = _initial_cache(model, params, inputs, length)
  shared = {k: v for k, v in flat.items() if _is_per_sentence(k)}
  carried = traverse_util.unflatten_dict({k: v for k, v in flat.items() if k not in shared})
  return DecoderState(
    _cached_step(model, params, shared),
    carried,
    _grow if grows else None,
    length if grows else None,
  )


def ensemble_decoder_state(
  model, params, inputs, max_decode_len: int, segment: int | None = DECODE_SEGMENT
) -> DecoderState:
  """`decoder_state` of an ensemble: `params` holds the members' parameter trees stacked on a
  leading axis ([members, ...] every leaf, same architecture). Each step runs every member
  (`vmap`) and returns the log of the members' mean next-token probability,
  log(1/M * sum_m p_m(y | prefix)), the ensemble fairseq decodes with; the search treats it as
  one model's logits.

  The carried cache holds each per-position entry as [n, members, ...] (the search's leading
  axis stays the row axis, so beams expand and reorder as for one model); scalar entries (the
  decode index) are the same for every member and kept once.
  """
  members = {leaf.shape[0] for leaf in jax.tree_util.tree_leaves(params)}
  if len(members) != 1:
    raise ValueError(
      f"ensemble: every parameter needs the same leading (member) axis, got sizes {sorted(members)}"
    )
  (num,) = members
  first = jax.tree_util.tree_map(lambda x: x[0], params)
  length, grows = _cache_length(model, first, inputs, max_decode_len, segment)
  flat = jax.vmap(lambda p: _initial_cache(model, p, inputs, length))(params)  # [members, ...]
  shared = {k: v for k, v in flat.items() if _is_per_sentence(k)}
  scalar = {k for k, v in flat.items() if v.ndim == 1 and k not in shared}
  carried = {
    k: (v[0] if k in scalar else jnp.moveaxis(v, 0, 1)) for k, v in flat.items() if k not in shared
  }
  axes = {k: (None if k in scalar else 1) for k in carried}

  def member(p, per_sentence, cache, ids):
    logits, cache = _cached_step(model, p, per_sentence)(ids, traverse_util.unflatten_dict(cache))
    return jax.nn.log_softmax(logits), traverse_util.flatten_dict(cache)

  def step(ids, cache):
    logp, cache = jax.vmap(member, in_axes=(0, 0, axes, None), out_axes=(0, axes))(
      params, shared, traverse_util.flatten_dict(cache), ids
    )
    mixed = jax.nn.logsumexp(logp, axis=0) - jnp.log(jnp.float32(num))
    return mixed, traverse_util.unflatten_dict(cache)

  return DecoderState(
    step, traverse_util.unflatten_dict(carried), _grow if grows else None, length if grows else None
  )


def _uncached_step(model, params):
  """step_fn without a cache: re-runs the whole teacher-forced model on the prefix each step.

  State: `inputs` [n, src_len]; `targets` [n, max_len], the tokens generated so far, then a
  non-PAD filler (so the current position is not masked as padding); `t` [] the step.
  """

  def step(ids, state):
    t, targets = state["t"], state["targets"]
    written = lax.dynamic_update_slice(targets, ids, (0, jnp.maximum(t - 1, 0)))
    targets = jnp.where(t > 0, written, targets)  # step 0 gets the start symbol: nothing to write
    logits = model.apply({"params": params}, state["inputs"], targets)  # [n, max_len, vocab]
    logits = lax.dynamic_index_in_dim(logits, t, axis=1, keepdims=False)
    return _mask_pad(logits), {"inputs": state["inputs"], "targets": targets, "t": t + 1}

  return step


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
    beam_size: 1 = greedy search; more = beam search with length penalty exponent `alpha`.
    max_extra_len: a sentence's output has at most (its source tokens + this) tokens, EOS
      included (the last one forced to EOS).
    max_decode_len: static output width; default src_len + max_extra_len (capped by
      `position_limit(model)`). Rows reaching it stop without EOS.
    rng, temperature, top_k: temperature > 0 samples (from the top_k tokens when top_k > 0)
      instead of searching; rng defaults to `jax.random.key(0)`.
    use_cache: False re-runs the full model on the prefix every step (same output, slower).
    segment: self-attention caches grow this many positions at a time (None: allocate
      `max_decode_len` at once); same output, faster for long outputs (`decoder_state`).
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


def compiled_count() -> int:
  """Number of compilations `translate` holds (all settings and shapes together)."""
  return sum(fn._cache_size() for fn in _COMPILED.values())


# ---------------------------------------------------------------------------------------------
# Many sentences: batches of similar length.


def bucket_length(n: int) -> int:
  """Padded length for a sentence of `n` tokens: the smallest of 8, 12, 16, 24, 32, 48, ...
  (2^k and 1.5 * 2^k) that is >= n, so padding wastes at most a third."""
  length = MIN_BUCKET
  while length < n:
    length = length * 3 // 2 if length & (length - 1) == 0 else length // 3 * 4
  return length


class LengthBatch(NamedTuple):
  """One batch of `length_batches`: `inputs` [rows, length] padded ids; row j < len(indices) is
  sentence `indices[j]`, later rows repeat the last real row (filler)."""

  indices: np.ndarray
  inputs: np.ndarray


def length_batches(
  token_lists: Sequence[Sequence[int]], tokens_per_batch: int, batch_multiple: int = 1
) -> list[LengthBatch]:
  """Groups sentences of similar length into padded batches.

  Sentences are sorted by length and padded to `bucket_length`; a batch holds at most
  `tokens_per_batch // length` rows (at least `batch_multiple`), always a multiple of
  `batch_multiple`. A bucket's last, partial batch is rounded up to `batch_multiple` times a
  power of two rows, so few distinct shapes (compilations) occur.

  Returns:
    the batches; concatenating their `indices` gives every sentence index once.
  """
  if tokens_per_batch < 1 or batch_multiple < 1:
    raise ValueError(
      f"length_batches: tokens_per_batch ({tokens_per_batch}) and batch_multiple "
      f"({batch_multiple}) must be positive"
    )
  lengths = np.array([len(t) for t in token_lists], np.int64)
  order = np.argsort(lengths, kind="stable")
  buckets = np.array([bucket_length(n) for n in lengths[order]], np.int64)
  batches = []
  for length in np.unique(buckets):
    members = order[buckets == length]
    full = max(batch_multiple, tokens_per_batch // length // batch_multiple * batch_multiple)
    for start in range(0, len(members), full):
      indices = members[start : start + full]
      groups = -(-len(indices) // batch_multiple)
      rows = min(full, batch_multiple * (1 << (groups - 1).bit_length()))
      ids = np.zeros((rows, int(length)), np.int32)
      for row, i in enumerate(indices):
        ids[row, : lengths[i]] = token_lists[i]
      ids[len(indices) :] = ids[len(indices) - 1]
      batches.append(LengthBatch(indices, ids))
  return batches


def translate_all(
  model,
  params,
  token_lists: Sequence[Sequence[int]],
  *,
  tokens_per_batch: int = 4096,
  batch_multiple: int = 1,
  **kwargs,
) -> list[np.ndarray]:
  """`translate` over any number of sentences, batched by `length_batches`.

  Args:
    token_lists: source ids of each sentence, each ending in EOS.
    tokens_per_batch: padded source tokens per batch (beam search multiplies the work by beam).
    **kwargs: passed to `translate` (beam_size, alpha, max_extra_len, ...); `rng` (default
      `jax.random.key(0)`) is folded with the batch's number, so batches of the same shape
      sample independently.

  Returns:
    per sentence, in input order: its translation's ids [tokens] (no EOS, no PAD).
  """
  outputs: list[np.ndarray | None] = [None] * len(token_lists)
  rng = kwargs.pop("rng", None)
  rng = jax.random.key(0) if rng is None else rng
  for n, batch in enumerate(length_batches(token_lists, tokens_per_batch, batch_multiple)):
    kwargs["rng"] = jax.random.fold_in(rng, n)
    ids = np.asarray(translate(model, params, batch.inputs, **kwargs))
    for row, i in enumerate(batch.indices):
      outputs[i] = strip(ids[row])
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
