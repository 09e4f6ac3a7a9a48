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

import jax.numpy as jnp
from jax import lax

from model import distribution
from model.search import expand_to_beams, gather_beams, segmented_loop
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
    alpha: Marian's `normalize`: finished scores are divided by `len ** alpha`.
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
  rows = jnp.arange(b)[:, None]
  slots = jnp.arange(k)[None, :]

  def body(s):
    t, live_logp, count, tok, seqs, tokp, fin, cache = s
    logits, cache = step_fn(tok.reshape(b * k, 1), cache)
    logp = distribution.log_probs(logits).reshape(b, k, -1)
    logp = logp.at[..., UNK_ID].set(NEG_INF)
    if prefix is not None:
      logp = distribution.force(logp, prefix_token(prefix, t)[:, None], True)
    vocab = logp.shape[-1]
    cand = (live_logp[..., None] + logp).reshape(b, k * vocab)
    score, flat = lax.top_k(cand, k)  # [b, k], best first
    parent, word = flat // vocab, (flat % vocab).astype(jnp.int32)
    kept = (slots < count[:, None]) & (score > NEG_INF)
    last = (t + 1 >= max_lens)[:, None] | (t + 1 >= max_len)
    ends = kept & ((word == EOS_ID) | last)
    stays = kept & ~ends
    new_seqs = jnp.take_along_axis(seqs, parent[..., None], axis=1)
    new_seqs = new_seqs.at[:, :, t].set(jnp.where(kept, word, PAD_ID))
    gain = jnp.take_along_axis(logp.reshape(b, k * vocab), flat, axis=1)
    new_tokp = jnp.take_along_axis(tokp, parent[..., None], axis=1)
    new_tokp = new_tokp.at[:, :, t].set(jnp.where(kept, gain, 0.0))
    # Finished ones go to the next free slots of the finished set, in score order.
    fin_ids, fin_tokp, fin_score, fin_count = fin
    place = fin_count[:, None] + jnp.cumsum(ends, axis=1) - 1
    place = jnp.where(ends, place, k)  # k: dropped by the scatter
    normed = score / (t + 1.0) ** alpha
    fin_ids = fin_ids.at[rows, place].set(new_seqs, mode="drop")
    fin_tokp = fin_tokp.at[rows, place].set(new_tokp, mode="drop")
    fin_score = fin_score.at[rows, place].set(normed, mode="drop")
    fin = (fin_ids, fin_tokp, fin_score, fin_count + jnp.sum(ends, axis=1))
    # The live ones move to the front, in score order; the other slots are dead.
    order = jnp.argsort(jnp.where(stays, slots, k + slots), axis=1)
    take = lambda x: jnp.take_along_axis(x, order.reshape(order.shape + (1,) * (x.ndim - 2)), 1)
    live = take(stays)
    live_logp = jnp.where(live, take(score), NEG_INF)
    tok = jnp.where(live, take(word), PAD_ID)
    parents = jnp.where(live, take(parent), 0)
    cache = gather_beams(cache, parents, b, k)
    count = jnp.sum(stays, axis=1)
    return (t + 1, live_logp, count, tok, take(new_seqs), take(new_tokp), fin, cache)

  def cond(s):
    return (s[0] < max_len) & jnp.any(s[2] > 0)

  # Step 0 reads one start hypothesis per sentence (slot 0) and keeps `beam_size` of its
  # continuations: the live count starts at k with one scored slot.
  live_logp = jnp.where(slots == 0, 0.0, NEG_INF) * jnp.ones((b, 1))
  fin = (
    jnp.full((b, k, max_len), PAD_ID, jnp.int32),
    jnp.zeros((b, k, max_len), jnp.float32),
    jnp.full((b, k), NEG_INF, jnp.float32),
    jnp.zeros((b,), jnp.int32),
  )
  state = (
    jnp.int32(0),
    live_logp.astype(jnp.float32),
    jnp.full((b,), k, jnp.int32),
    jnp.zeros((b, k), jnp.int32),
    jnp.full((b, k, max_len), PAD_ID, jnp.int32),
    jnp.zeros((b, k, max_len), jnp.float32),
    fin,
    expand_to_beams(cache, k),
  )
  state = segmented_loop(
    cond,
    body,
    state,
    max_len,
    segment,
    grow,
    lambda st: st[0],
    lambda st: st[7],
    lambda st, c: st[:7] + (c,),
  )
  fin_ids, fin_tokp, fin_score, _ = state[6]
  order = jnp.argsort(-fin_score, axis=1, stable=True)
  take = lambda x: jnp.take_along_axis(x, order.reshape(order.shape + (1,) * (x.ndim - 2)), 1)
  found = (take(fin_ids), take(fin_score))
  return found + (take(fin_tokp),) if token_scores else found
