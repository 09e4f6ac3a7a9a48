"""The decoder state a search runs on (model/search.py's step function contract) for a model
from `model.build.build_model`: the key/value cache (encode once, one target position per step),
its self-attention buffers grown segment by segment, an ensemble's members run as one model, and
the uncached reference that re-runs the whole model on the prefix every step.

    state = decoder_state(model, params, inputs, max_decode_len)   # .step, .cache, .grow, .segment
    ids, scores = search.beam_search(state.step, state.cache, batch, max_decode_len,
                                     grow=state.grow, segment=state.segment, ...)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import traverse_util
from jax import lax

from model.special_tokens import EOS_ID, PAD_ID


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


_MATRICES = ("kernel", "embedding")  # the parameters that products read (model/layers.py)


def matrices_in_compute_dtype(model, params):
  """`params` with every matrix the model multiplies by (its `kernel` and `embedding` leaves) in
  the model's computation dtype: cast once per decoding, where XLA:CPU would cast each one again
  in every step of the search loop. Nothing changes in float32."""
  dtype = model.config.compute_dtype
  if dtype == jnp.float32:
    return params
  return jax.tree_util.tree_map_with_path(
    lambda path, x: x.astype(dtype) if getattr(path[-1], "key", None) in _MATRICES else x, params
  )


# Self-attention key/value buffers (model/layers.py): one slot per position on axis -2.
_GROWN = ("cached_key", "cached_value")
DECODE_SEGMENT = 16  # default: self-attention buffers start at 16 positions, then double


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
  segment by segment, each twice as long as the one before (model/search.py), so early steps do
  not stream (or, in beam search, reorder) the empty rest of a `max_decode_len` buffer; None
  allocates all of it at once."""
  if not use_cache:
    cache = {
      "inputs": inputs,
      "targets": jnp.full((inputs.shape[0], max_decode_len), EOS_ID, jnp.int32),
      "t": jnp.int32(0),
    }
    return DecoderState(_uncached_step(model, params), cache)
  params = matrices_in_compute_dtype(model, params)
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
  params = matrices_in_compute_dtype(model, params)
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
