"""Continuous batching's device side: a fixed pool of decoding rows that sentences enter and leave
one by one, as pure functions of arrays (inference/continuous.py drives it from the host).

    spec = PoolSpec(model, SearchSettings(beam_size=4), pool_size=32, source_len=32, queue_size=32)
    pool = empty_pool(spec, params)
    pool, out, taken = advance(spec, params, pool, queue, queue_ids, count, rng, steps, drain)

The pool has `pool_size` slots of `beam_size` rows each (one row for greedy search and sampling).
A slot holds one sentence: its encoder keys and values (the cache's `SOURCE` entries,
model/cache_kinds.py, one row per slot), its `STATE` and `TARGET` rows (one per hypothesis), and its
search state (model/search.py's beam state with every slot at its own step). Each step runs the
decoder once over all rows; a sentence done by its search's rule (beam search's stopping rule,
EOS for greedy search and sampling) or at its own length limit leaves the pool, its hypotheses
written to the output buffer, and the next waiting sentence of the queue is encoded and placed in
the freed slot, its cache rows and search state reset. Nothing depends on which slot a sentence
gets or on its neighbours: each sentence is translated as the batch-at-once search
(model/generate.py) translates it, and a sampled sentence draws its noise from `rng`, its index
and its step alone.

Sources are padded to one `source_len` and the self-attention buffers sized to `max_decode_len`,
so one program (`advance`, jitted with the spec static) serves every sentence of a file. The
decoder steps with per-row decode indices: a model's cache counters shared by all rows (rank-0
`STATE` entries, e.g. the Transformer's `cache_index` and `position`) become one per row, which
the layers accept (model/layers.py `write_position`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from model import cache_kinds, distribution, search
from model.decoder_state import (
  cached_step,
  ensemble_step,
  initial_cache,
  matrices_for_decoding,
  only_ids_below,
)
from model.search_settings import SearchSettings
from model.special_tokens import PAD_ID
from model.token_step import Tokens, next_log_probs, output_limits, token_advance


@dataclasses.dataclass(frozen=True)
class PoolSpec:
  """What one compiled pool program is made for (static; hashable).

  model: a module from `model.build.build_model`; settings: how to search (greedy search, beam
  search or sampling; each sentence's output limit is its source tokens + max_extra_len, EOS
  included), as `settings.program()` gives them; pool_size: sentences decoded at once;
  source_len: the padded source width (the outputs are `max_decode_len` = source_len +
  max_extra_len wide); queue_size: sentences offered per `advance` call; num_ids: only ids below
  it are emitted (None: every id); ensemble: params are several members' stacked on a leading
  axis, decoded by the mean of their probabilities (model/decoder_state.py
  `ensemble_decoder_state`); token_scores: the finished sentences come with each hypothesis'
  per-token log-probabilities (`Finished.token_scores`); prefix_len: the width P of the target
  prefixes the queue brings (`advance`'s `queue_prefix`; 0: none), more than the longest prefix.
  """

  model: Any
  settings: SearchSettings
  pool_size: int
  source_len: int
  queue_size: int
  num_ids: int | None = None
  ensemble: bool = False
  token_scores: bool = False
  prefix_len: int = 0

  @property
  def beam_size(self) -> int:
    return self.settings.beam_size

  @property
  def max_decode_len(self) -> int:
    return max(self.source_len, self.prefix_len) + self.settings.max_extra_len

  @property
  def out_size(self) -> int:
    """Sentences one `advance` call can finish: those in the pool and those it takes."""
    return self.pool_size + self.queue_size


class Pool(NamedTuple):
  """The pool between calls. `state` is model/search.py's beam state with one entry per slot
  (`t` [slots], every slot at its own step; `cache` the carried `STATE`/`TARGET` entries, leaves
  [rows, ...], or [rows, members, ...] for an ensemble); `source` the `SOURCE` entries, leaves
  [slots, ...] ([members, slots, ...]); `index` [slots] the sentence in each slot (-1: empty);
  `max_lens` [slots] its output limit, EOS included; `prefix` [slots, prefix_len] its target
  prefix (model/search.py; None without `PoolSpec.prefix_len`)."""

  state: Any
  source: Any
  index: jax.Array
  max_lens: jax.Array
  prefix: jax.Array | None = None


class Finished(NamedTuple):
  """The sentences one `advance` call finished, in the order they did: `index` [out] the
  sentence's index, `ids` [out, beam, max_decode_len] its hypotheses (PAD after EOS) and
  `scores` [out, beam] their scores, best first (beam search's length-normalised scores; for
  greedy search and sampling the summed log-probability of the tokens chosen, a forced EOS
  counting 0); rows from `count` on are unused. With `PoolSpec.token_scores`, `token_scores`
  [out, beam, max_decode_len] holds each hypothesis' per-token log-probabilities (0 after its
  last token), else None."""

  index: jax.Array
  ids: jax.Array
  scores: jax.Array
  count: jax.Array
  token_scores: jax.Array | None = None


def _per_row(tree):
  """A cache of one sentence with its rank-0 counters (shared by all rows) made [1] vectors."""
  return jax.tree_util.tree_map(lambda x: x.reshape(1) if x.ndim == 0 else x, tree)


def _sentence_cache(spec: PoolSpec, params, inputs):
  """(source, carried) of one sentence `inputs` [1, source_len]: its `SOURCE` entries (leaves
  [1, ...]; [members, 1, ...]) and its carried entries expanded to its beams (leaves
  [beam, ...]; [beam, members, ...])."""

  def one(p):
    full = initial_cache(spec.model, p, inputs, spec.max_decode_len)
    return full[cache_kinds.SOURCE], _per_row({kind: full[kind] for kind in cache_kinds.CARRIED})

  if not spec.ensemble:
    source, carried = one(params)
  else:
    source, carried = jax.vmap(one)(params)
    carried = jax.tree_util.tree_map(lambda x: jnp.moveaxis(x, 0, 1), carried)
  return source, search.expand_to_beams(carried, spec.beam_size)


def _step(spec: PoolSpec, params, source, carried, ids):
  """The decoder over every row: ids [rows, 1] -> (float32 logits [rows, vocab], carried)."""
  if not spec.ensemble:
    step = cached_step(spec.model, params, source)
  else:  # every carried entry is per row here, the members on axis 1
    step = ensemble_step(spec.model, params, source, axes=1)
  return only_ids_below(step, spec.num_ids)(ids, carried)


def empty_pool(spec: PoolSpec, params) -> Pool:
  """A pool with every slot empty (zero caches)."""
  inputs = jax.ShapeDtypeStruct((1, spec.source_len), jnp.int32)
  source, carried = jax.eval_shape(
    lambda p, i: _sentence_cache(spec, matrices_for_decoding(spec.model, p, spec.ensemble), i),
    params,
    inputs,
  )

  def zeros(leaf, axis):  # one sentence's entry -> every slot's
    shape = list(leaf.shape)
    shape[axis] *= spec.pool_size
    return jnp.zeros(shape, leaf.dtype)

  source = jax.tree_util.tree_map(lambda x: zeros(x, 1 if spec.ensemble else 0), source)
  carried = jax.tree_util.tree_map(lambda x: zeros(x, 0), carried)
  state = search.beam_start(
    spec.pool_size, spec.beam_size, spec.max_decode_len, carried, spec.token_scores
  )
  state = state._replace(t=jnp.zeros((spec.pool_size,), jnp.int32))
  index = jnp.full((spec.pool_size,), -1, jnp.int32)
  prefix = jnp.zeros((spec.pool_size, spec.prefix_len), jnp.int32) if spec.prefix_len else None
  return Pool(state, source, index, jnp.zeros((spec.pool_size,), jnp.int32), prefix)


def _restart(s, entry):
  """The pool's search state `s` (model/search.py's beam state, `s.t` [slots]) with slot `entry`
  ([] int) back at `search.beam_start`'s state; the cache as it was (`_place` puts the slot's)."""
  k = s.tok.shape[1]
  fresh = search.beam_start(1, k, s.live_seqs.shape[-1], token_scores=s.live_tokp is not None)
  put = lambda big, new: lax.dynamic_update_slice_in_dim(big, new.astype(big.dtype), entry, 0)
  per_entry = [
    name for name in type(s)._fields if name not in ("t", "cache") and getattr(s, name) is not None
  ]
  return s._replace(
    **{name: put(getattr(s, name), getattr(fresh, name)) for name in per_entry},
    t=s.t.at[entry].set(0),
  )


def _put(big, new, start, axis: int):
  return lax.dynamic_update_slice_in_dim(big, new.astype(big.dtype), start, axis)


def _place(spec: PoolSpec, params, pool: Pool, slot, inputs, index, prefix) -> Pool:
  """`pool` with sentence `index` (`inputs` [1, source_len], `prefix` [1, prefix_len] or None)
  encoded into `slot`: its source entries, its rows' carried entries and its search state reset,
  its prefix and output limit set (as model/generate.py sets them)."""
  k = spec.beam_size
  source, carried = _sentence_cache(spec, params, inputs)
  axis = 1 if spec.ensemble else 0
  source = jax.tree_util.tree_map(lambda b, n: _put(b, n, slot, axis), pool.source, source)
  carried = jax.tree_util.tree_map(lambda b, n: _put(b, n, slot * k, 0), pool.state.cache, carried)
  state = _restart(pool.state, slot)._replace(cache=carried)
  length = output_limits(inputs, prefix, spec.settings.max_extra_len)[0]
  if prefix is not None:
    prefix = _put(pool.prefix, prefix, slot, 0)
  return Pool(
    state, source, pool.index.at[slot].set(index), pool.max_lens.at[slot].set(length), prefix
  )


def _choose(spec: PoolSpec, logp, keys):
  """Each row's token from its log-probabilities [slots, vocab]: the argmax (greedy), or drawn
  with its own key [slots] (sampling)."""
  settings = spec.settings
  if not settings.sampling:
    return distribution.choose(logp)
  return jax.vmap(
    lambda key, row: distribution.choose(row, key, settings.temperature, settings.top_k)
  )(keys, logp)


def _token_advance(spec: PoolSpec, s, logits, max_lens, keys, prefix):
  """One step of greedy search or sampling (model/token_step.py) with every slot at its own
  step, on the beam state of one hypothesis per slot (the summed log-probability in
  `live_logp`); `prefix` [slots, prefix_len] or None."""
  keep = spec.settings.prefix_rule == "forced"
  logp = next_log_probs(logits, s.t, max_lens=max_lens, prefix=prefix, keep=keep)
  tokp = None if s.live_tokp is None else s.live_tokp[:, 0]
  rows = Tokens(s.t, s.tok[:, 0], s.live_seqs[:, 0], s.done, s.live_logp[:, 0], tokp)
  rows = token_advance(rows, logp, lambda logp: _choose(spec, logp, keys))
  return s._replace(
    t=rows.t,
    tok=rows.tok[:, None],
    live_seqs=rows.seqs[:, None],
    live_logp=rows.total[:, None],
    done=rows.done,
    live_tokp=None if tokp is None else rows.token_logp[:, None],
  )


def _is_token_search(spec: PoolSpec) -> bool:
  """Greedy search and sampling run `_token_advance`; beam search `search.beam_advance`."""
  return spec.beam_size == 1


def _results(spec: PoolSpec, s):
  """Every slot's hypotheses [slots, beam, max_decode_len] and scores [slots, beam] (and, with
  `spec.token_scores`, per-token log-probabilities [slots, beam, max_decode_len])."""
  if _is_token_search(spec):
    found = s.live_seqs, s.live_logp
    return found if s.live_tokp is None else (*found, s.live_tokp)
  return search.beam_best(s, spec.settings.alpha, spec.settings.length_penalty)


class _Loop(NamedTuple):
  """`advance`'s loop state."""

  pool: Pool
  out: Finished
  taken: jax.Array  # [] queue entries placed so far
  steps: jax.Array  # [] decoder steps run


def _refill(spec: PoolSpec, params, c: _Loop, queue, queue_index, count, queue_prefix) -> _Loop:
  """`c` with the queue's next waiting sentences placed in the free slots, while both last."""

  def cond(c):
    return jnp.any(c.pool.index < 0) & (c.taken < count)

  def body(c):
    slot = jnp.argmax(c.pool.index < 0)
    inputs = lax.dynamic_slice_in_dim(queue, c.taken, 1, axis=0)
    prefix = None
    if spec.prefix_len:
      prefix = lax.dynamic_slice_in_dim(queue_prefix, c.taken, 1, axis=0)
    pool = _place(spec, params, c.pool, slot, inputs, queue_index[c.taken], prefix)
    return c._replace(pool=pool, taken=c.taken + 1)

  return lax.while_loop(cond, body, c)


def _emit(spec: PoolSpec, c: _Loop, finished) -> _Loop:
  """`c` with the slots `finished` [slots] written to the output, in slot order, and emptied."""
  ids, scores, *tokp = _results(spec, c.pool.state)
  at = jnp.where(finished, c.out.count + jnp.cumsum(finished) - 1, spec.out_size)
  out = Finished(
    c.out.index.at[at].set(c.pool.index, mode="drop"),
    c.out.ids.at[at].set(ids, mode="drop"),
    c.out.scores.at[at].set(scores, mode="drop"),
    c.out.count + jnp.sum(finished, dtype=jnp.int32),
    c.out.token_scores.at[at].set(tokp[0], mode="drop") if tokp else None,
  )
  return c._replace(pool=c.pool._replace(index=jnp.where(finished, -1, c.pool.index)), out=out)


def _search_step(spec: PoolSpec, params, pool: Pool, rng):
  """The search state after one decoder step over every row (each slot at its own step)."""
  slots, k = spec.pool_size, spec.beam_size
  s = pool.state
  logits, carried = _step(spec, params, pool.source, s.cache, s.tok.reshape(slots * k, 1))
  if _is_token_search(spec):
    keys = jax.vmap(lambda i, t: jax.random.fold_in(jax.random.fold_in(rng, i), t))(pool.index, s.t)
    s = _token_advance(spec, s, logits, pool.max_lens, keys, pool.prefix)
    return s._replace(cache=carried)
  s, parents = search.beam_advance(
    s,
    logits,
    alpha=spec.settings.alpha,
    penalty=spec.settings.length_penalty,
    stopping=spec.settings.stopping,
    max_lens=pool.max_lens,
    max_len=spec.max_decode_len,
    prefix=pool.prefix,
    prefix_rule=spec.settings.prefix_rule,
  )
  return s._replace(cache=search.gather_beams(carried, parents, slots, k))


def _no_output(spec: PoolSpec) -> Finished:
  """An output buffer with nothing finished yet."""
  k, width = spec.beam_size, spec.max_decode_len
  return Finished(
    jnp.full((spec.out_size,), -1, jnp.int32),
    jnp.full((spec.out_size, k, width), PAD_ID, jnp.int32),
    jnp.full((spec.out_size, k), -jnp.inf, jnp.float32),
    jnp.int32(0),
    jnp.zeros((spec.out_size, k, width), jnp.float32) if spec.token_scores else None,
  )


def advance(
  spec: PoolSpec,
  params,
  pool: Pool,
  queue,
  queue_index,
  count,
  rng,
  max_steps,
  drain,
  queue_prefix=None,
) -> tuple[Pool, Finished, jax.Array]:
  """Runs the pool until it needs the host: up to `max_steps` decoder steps, placing the queue's
  sentences in slots as they free up, and stopping early once the queue is used up while a slot
  is free (unless `drain`: then until the pool is empty).

  Args:
    queue: [queue_size, source_len] source ids (EOS included, 0 on padding); the first `count`
      rows are waiting sentences, taken in order; `queue_index` [queue_size] their indices.
    rng: the sampling key (a sentence's noise: `rng` folded with its index, then its step).
    max_steps, drain: [] int32 and bool (traced: any value, the same program).
    queue_prefix: [queue_size, prefix_len] the waiting sentences' target prefixes (tokens, then
      PAD), with `spec.prefix_len` only.
  Returns:
    the pool, the sentences finished (`Finished`) and how many queue rows were taken.
  """
  params = matrices_for_decoding(spec.model, params, spec.ensemble)
  refill = lambda c: _refill(spec, params, c, queue, queue_index, count, queue_prefix)

  def body(c: _Loop) -> _Loop:
    s = _search_step(spec, params, c.pool, rng)
    c = c._replace(pool=c.pool._replace(state=s), steps=c.steps + 1)
    finished = (c.pool.index >= 0) & (s.done | (s.t >= spec.max_decode_len))
    c = lax.cond(jnp.any(finished), lambda c: _emit(spec, c, finished), lambda c: c, c)
    return refill(c)

  def cond(c: _Loop):
    occupied = c.pool.index >= 0
    starving = (c.taken >= count) & ~jnp.all(occupied) & ~drain
    return (c.steps < max_steps) & jnp.any(occupied) & ~starving

  c = refill(_Loop(pool, _no_output(spec), jnp.int32(0), jnp.int32(0)))
  c = lax.while_loop(cond, body, c)
  return c.pool, c.out, c.taken
