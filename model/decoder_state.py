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
from jax import lax

from model import cache_kinds, distribution
from model.config import INT8
from model.quantize import MATRICES, quantize_matrices
from model.special_tokens import EOS_ID


def cached_step(model, params, source=None, num_ids: int | None = None):
  """step_fn over the model's decoding cache: one decoder position per call, its logits float32
  with PAD (and with `num_ids` every id >= num_ids) at -inf (`distribution.mask`; a model with
  `masks_logits` masks them in its own `decode_step`). The search carries the `STATE` and
  `TARGET` entries ({kind: tree}); `source` holds the `SOURCE` entries, shared by all beams of a
  sentence (closed over, so search neither copies them per beam nor reorders them each step).
  model/cache_kinds.py says which entry is which."""
  own = {"masked": True, "num_ids": num_ids} if getattr(model, "masks_logits", False) else None

  def step(ids, carried):
    variables = {"params": params, **carried}
    if source:
      variables[cache_kinds.SOURCE] = source
    logits, state = model.apply(
      variables, ids, **(own or {}), method="decode_step", mutable=cache_kinds.CARRIED
    )
    logits = logits if own else distribution.mask(logits, num_ids)
    return logits, {kind: state.get(kind, {}) for kind in cache_kinds.CARRIED}

  return step


def matrices_for_decoding(model, params, leading: int = 0):
  """`params` with every matrix the model multiplies by (its `kernel` and `embedding` leaves) as
  its products take it: cast to the computation dtype, or quantized (model/quantize.py) for
  model.dtype 'int8'; once per decoding, where XLA:CPU would convert each one again in every step
  of the search loop. Nothing changes in float32, nor for matrices already quantized.
  `leading`: axes in front of every leaf (1 for an ensemble's stacked members, whose count is
  checked: `distribution.members`)."""
  if leading:
    distribution.members(params, "ensemble")
  if getattr(model.config, "dtype", None) == INT8:
    return quantize_matrices(params, leading)
  dtype = model.config.compute_dtype
  if dtype == jnp.float32:
    return params
  return jax.tree_util.tree_map_with_path(
    lambda path, x: x.astype(dtype) if getattr(path[-1], "key", None) in MATRICES else x, params
  )


DECODE_SEGMENT = 16  # default: self-attention buffers start at 16 positions, then double


class DecoderState(NamedTuple):
  """What model/search.py's functions take: `step` and `cache` (the step function contract),
  and, for a cache whose `TARGET` buffers start at `segment` positions, the `grow` function that
  enlarges them (None: the cache is sized for the whole output)."""

  step: Callable
  cache: object
  grow: Callable | None = None
  segment: int | None = None


def grow_target(carried, extra: int):
  """The carried cache with `extra` more (zero) positions in every `TARGET` buffer (axis -2)."""
  pad = lambda v: jnp.pad(v, [(0, 0)] * (v.ndim - 2) + [(0, extra), (0, 0)])
  return {**carried, cache_kinds.TARGET: jax.tree_util.tree_map(pad, carried[cache_kinds.TARGET])}


def initial_cache(model, params, inputs, length: int) -> dict:
  """Encodes `inputs` and returns the model's decoding cache for `length` target positions:
  {kind: tree} for each kind of model/cache_kinds.py (empty trees for kinds the model has none
  of)."""
  encoded = model.apply({"params": params}, inputs, method="encode")
  _, state = model.apply(
    {"params": params}, encoded, inputs, length, method="init_cache", mutable=True
  )
  state = {kind: tree for kind, tree in state.items() if kind != "params"}
  cache_kinds.check_collections(state, getattr(model, "kind", None) or type(model).__name__)
  return {kind: state.get(kind, {}) for kind in cache_kinds.COLLECTIONS}


def first_cache(init: Callable[[int], dict], max_decode_len: int, segment: int | None):
  """(the initial cache `init(length)`, its length when its `TARGET` buffers grow, else None):
  `segment` positions when the cache has buffers to grow, else `max_decode_len` (recurrent
  state). A cache with nothing to grow is made again at full length, so the common case traces
  the encoder once."""
  first = max_decode_len if not segment or segment >= max_decode_len else int(segment)
  initial = init(first)
  if first == max_decode_len:
    return initial, None
  if jax.tree_util.tree_leaves(initial[cache_kinds.TARGET]):
    return initial, first
  return init(max_decode_len), None


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

  With `segment`, `TARGET` buffers start at `segment` positions and the search grows them
  segment by segment, each twice as long as the one before (model/search.py), so early steps do
  not stream (or, in beam search, reorder) the empty rest of a `max_decode_len` buffer; None
  allocates all of it at once."""
  if not use_cache:
    state = {
      "inputs": inputs,
      "targets": jnp.full((inputs.shape[0], max_decode_len), EOS_ID, jnp.int32),
      "t": jnp.int32(0),
    }
    return DecoderState(_uncached_step(model, params), state)
  params = matrices_for_decoding(model, params)
  initial, length = first_cache(
    lambda n: initial_cache(model, params, inputs, n), max_decode_len, segment
  )
  return DecoderState(
    cached_step(model, params, initial[cache_kinds.SOURCE]),
    {kind: initial[kind] for kind in cache_kinds.CARRIED},
    None if length is None else grow_target,
    length,
  )


def ensemble_decoder_state(
  model, params, inputs, max_decode_len: int, segment: int | None = DECODE_SEGMENT
) -> DecoderState:
  """`decoder_state` of an ensemble: `params` holds the members' parameter trees stacked on a
  leading axis ([members, ...] every leaf, same architecture). Each step runs every member
  (`vmap`) and returns the log of the members' mean next-token probability,
  log(1/M * sum_m p_m(y | prefix)), the ensemble fairseq decodes with; the search treats it as
  one model's logits.

  The carried cache holds each per-row entry as [n, members, ...] (the search's leading axis
  stays the row axis, so beams expand and reorder as for one model); scalar entries (decode
  indices) are the same for every member and kept once.
  """
  params = matrices_for_decoding(model, params, leading=1)
  members = lambda n: jax.vmap(lambda p: initial_cache(model, p, inputs, n))(params)
  initial, length = first_cache(members, max_decode_len, segment)  # [members, ...]
  source = initial[cache_kinds.SOURCE]
  stacked = {kind: initial[kind] for kind in cache_kinds.CARRIED}
  carried = jax.tree_util.tree_map(
    lambda v: v[0] if v.ndim == 1 else jnp.moveaxis(v, 0, 1), stacked
  )
  axes = jax.tree_util.tree_map(lambda v: None if v.ndim == 1 else 1, stacked)
  step = ensemble_step(model, params, source, axes)
  return DecoderState(step, carried, None if length is None else grow_target, length)


def ensemble_step(model, params, source, axes):
  """step_fn of an ensemble (`ensemble_decoder_state`): every member's `cached_step` (`params`
  and `source` stacked on a leading member axis), mixed by `distribution.mixed`. `axes`: the
  member axis of each carried entry (a tree of them, None for an entry kept once, or one int
  for all)."""

  def member(p, source, carried, ids):
    logits, carried = cached_step(model, p, source)(ids, carried)
    return distribution.log_probs(logits), carried

  def step(ids, carried):
    return distribution.mixed(
      member, params, source, carried, ids, in_axes=(0, axes, None), out_axes=axes
    )

  return step


def only_ids_below(step, num_ids: int | None):
  """step_fn whose logits for ids >= num_ids (output rows the vocabulary has no piece for) are
  -inf, so no search can emit them (None: `step` itself)."""
  if num_ids is None:
    return step

  def masked(ids, cache):
    logits, cache = step(ids, cache)
    return distribution.mask_ids(logits, num_ids), cache

  return masked


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
    return distribution.mask(logits), {"inputs": state["inputs"], "targets": targets, "t": t + 1}

  return step
