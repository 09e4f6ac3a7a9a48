"""Marian's beam search (marian-dev src/translator/beam_search.cpp, history.h), over the step
function of model/search.py.

    ids, scores = beam_search(step_fn, cache, batch, max_len, beam_size=4, alpha=1.0,
                              max_lens=3 * source_lengths)

How it differs from model/search.py's: a hypothesis that ends leaves the beam, which shrinks.
Step 0 takes the `beam_size` best first tokens; each later step keeps, of all continuations of
a sentence's `n` live hypotheses, the best `n` (fewer only when fewer have a finite score). A
kept continuation ending in EOS is finished, scored `logp / len ** alpha` with `len` its tokens
counting the EOS (`alpha` is Marian's `normalize`; 0 = plain log-probability); the others stay
live. `<unk>` is barred after the log-softmax (its probability stays in the normaliser, as
Marian's `allow-unk` false does). At step `t` with `t + 1 >= max_lens` (Marian's
`max-length-factor` times the source length, EOS counted) every kept continuation is finished
as it is, without an EOS; so is every live one when the output width `max_len` runs out. A
sentence is done when none of its hypotheses is live: it then has exactly `beam_size` finished
ones, and the best score wins (n-best: sorted best first).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from model import distribution
from model.search import expand_to_beams, gather_beams, length_penalty, segmented_loop
from model.special_tokens import EOS_ID, PAD_ID, UNK_ID
from model.token_step import prefix_token

NEG_INF = float("-inf")
LENGTH_FACTOR = 3  # Marian's max-length-factor


def max_lengths(inputs, prefix=None):
  """[batch] length limits: `LENGTH_FACTOR` times each source's tokens (EOS counted, PAD not),
  and at least a prefix's tokens + 1. inputs: [batch, src_len] ids; prefix: [batch, P] or None."""
  limit = LENGTH_FACTOR * jnp.sum(inputs != PAD_ID, axis=1, dtype=jnp.int32)
  if prefix is not None:
    limit = jnp.maximum(limit, jnp.sum(prefix != PAD_ID, axis=1, dtype=jnp.int32) + 1)
  return limit


class _Finished(NamedTuple):
  """Each sentence's finished hypotheses: ids, token log-probs [batch, beam, max_len], scores
  [batch, beam] (normalised), and how many [batch]."""

  ids: jax.Array
  tokp: jax.Array
  score: jax.Array
  count: jax.Array


class _Beam(NamedTuple):
  """The loop's state: step `t`, the live hypotheses (`count` [batch] of them, at the front;
  their scores `live_logp` [batch, beam], last tokens `tok`, ids `seqs` and token log-probs
  `tokp` [batch, beam, max_len]), the finished ones and the decoding cache."""

  t: jax.Array
  live_logp: jax.Array
  count: jax.Array
  tok: jax.Array
  seqs: jax.Array
  tokp: jax.Array
  fin: _Finished
  cache: object


def beam_search(
  step_fn,
  cache,
  batch_size: int,
  max_len: int,
  *,
  beam_size: int = 4,
  alpha=1.0,
  max_lens=None,
  token_scores: bool = False,
  prefix=None,
  grow=None,
  segment=None,
):
  """Marian's beam search (module doc); `beam_size=1` is Marian's greedy search.

  Args:
    step_fn, cache, batch_size, max_len, prefix, grow, segment: as model/search.py's
      `beam_search` (its module doc); the cache is expanded to `batch_size * beam_size` rows here.
    alpha: Marian's `normalize`: finished scores are divided by `len ** alpha` (a number or a
      traced scalar: `search.length_penalty`'s 'fairseq' form, a true division either way).
    max_lens: optional [batch] int, the length limit of each sentence (module doc).
    token_scores: also return each token's log-probability.
  Returns:
    ids [batch, beam, max_len] int32 (PAD after the last token), scores [batch, beam] float32,
    best first; with `token_scores`, a third array shaped as ids.
  """
  b, k = batch_size, beam_size
  if max_lens is None:
    max_lens = jnp.full((b,), max_len, jnp.int32)
  max_lens = jnp.asarray(max_lens, jnp.int32)
  slots = jnp.arange(k)[None, :]

  def body(s: _Beam) -> _Beam:
    logits, cache = step_fn(s.tok.reshape(b * k, 1), s.cache)
    logp = distribution.log_probs(logits).reshape(b, k, -1)
    logp = logp.at[..., UNK_ID].set(NEG_INF)
    if prefix is not None:
      logp = distribution.force(logp, prefix_token(prefix, s.t)[:, None], True)
    vocab = logp.shape[-1]
    cand = (s.live_logp[..., None] + logp).reshape(b, k * vocab)
    score, flat = lax.top_k(cand, k)  # [b, k], best first
    parent, word = flat // vocab, (flat % vocab).astype(jnp.int32)
    kept = (slots < s.count[:, None]) & (score > NEG_INF)
    last = (s.t + 1 >= max_lens)[:, None] | (s.t + 1 >= max_len)
    ends = kept & ((word == EOS_ID) | last)
    stays = kept & ~ends
    seqs = jnp.take_along_axis(s.seqs, parent[..., None], axis=1)
    seqs = seqs.at[:, :, s.t].set(jnp.where(kept, word, PAD_ID))
    gain = jnp.take_along_axis(logp.reshape(b, k * vocab), flat, axis=1)
    tokp = jnp.take_along_axis(s.tokp, parent[..., None], axis=1)
    tokp = tokp.at[:, :, s.t].set(jnp.where(kept, gain, 0.0))
    fin = _finish(s.fin, ends, seqs, tokp, score / length_penalty(s.t + 1, alpha, "fairseq"))
    # The live ones move to the front, in score order; the other slots are dead.
    take = _reorder(jnp.argsort(jnp.where(stays, slots, k + slots), axis=1))
    live = take(stays)
    return _Beam(
      t=s.t + 1,
      live_logp=jnp.where(live, take(score), NEG_INF),
      count=jnp.sum(stays, axis=1),
      tok=jnp.where(live, take(word), PAD_ID),
      seqs=take(seqs),
      tokp=take(tokp),
      fin=fin,
      cache=gather_beams(cache, jnp.where(live, take(parent), 0), b, k),
    )

  def cond(s: _Beam):
    return (s.t < max_len) & jnp.any(s.count > 0)

  state = segmented_loop(cond, body, _start(cache, b, k, max_len), max_len, segment, grow)
  take = _reorder(jnp.argsort(-state.fin.score, axis=1, stable=True))
  found = (take(state.fin.ids), take(state.fin.score))
  return found + (take(state.fin.tokp),) if token_scores else found


def _start(cache, b: int, k: int, max_len: int) -> _Beam:
  """Step 0 reads one start hypothesis per sentence (slot 0) and keeps `k` of its
  continuations: the live count starts at k with one scored slot."""
  slots = jnp.arange(k)[None, :]
  live_logp = jnp.where(slots == 0, 0.0, NEG_INF) * jnp.ones((b, 1))
  fin = _Finished(
    ids=jnp.full((b, k, max_len), PAD_ID, jnp.int32),
    tokp=jnp.zeros((b, k, max_len), jnp.float32),
    score=jnp.full((b, k), NEG_INF, jnp.float32),
    count=jnp.zeros((b,), jnp.int32),
  )
  return _Beam(
    t=jnp.int32(0),
    live_logp=live_logp.astype(jnp.float32),
    count=jnp.full((b,), k, jnp.int32),
    tok=jnp.zeros((b, k), jnp.int32),
    seqs=jnp.full((b, k, max_len), PAD_ID, jnp.int32),
    tokp=jnp.zeros((b, k, max_len), jnp.float32),
    fin=fin,
    cache=expand_to_beams(cache, k),
  )


def _finish(fin: _Finished, ends, seqs, tokp, normed) -> _Finished:
  """`fin` with the hypotheses `ends` [batch, beam] marks placed in the next free slots, in
  score order (a slot past the beam is dropped by the scatter)."""
  b, k = ends.shape
  rows = jnp.arange(b)[:, None]
  place = fin.count[:, None] + jnp.cumsum(ends, axis=1) - 1
  place = jnp.where(ends, place, k)
  return _Finished(
    ids=fin.ids.at[rows, place].set(seqs, mode="drop"),
    tokp=fin.tokp.at[rows, place].set(tokp, mode="drop"),
    score=fin.score.at[rows, place].set(normed, mode="drop"),
    count=fin.count + jnp.sum(ends, axis=1),
  )


def _reorder(order):
  """A function taking [batch, beam, ...] arrays into the beam order `order` [batch, beam]."""
  return lambda x: jnp.take_along_axis(x, order.reshape(order.shape + (1,) * (x.ndim - 2)), 1)
