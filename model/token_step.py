"""One decoding step of a row, written once: what the batch searches (model/search.py), the pool's
rows (model/pool.py) and the output-length rule of model/generate.py share.

    max_lens = output_limits(inputs, prefix, max_extra_len)   # [batch] tokens, EOS included
    logp = next_log_probs(logits, t, max_lens=max_lens, prefix=prefix, keep=True)
    s = token_advance(s, logp, choose)                        # greedy search's or sampling's step

`next_log_probs` is the distribution a step draws from: the step function's logits through
log-softmax in float32 (model/distribution.py), a target prefix's token forced where one is due
(`distribution.force`), and EOS the only token (at log-probability 0) once a row reaches its
length limit. Beam search takes its candidates from it (model/search.py `beam_advance`); greedy
search and sampling take one token per row (`token_advance`). A step runs every row at one step
(`t` []) or each at its own (`t` [batch]: continuous batching).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from model import distribution
from model.special_tokens import EOS_ID, PAD_ID


def output_limits(inputs, prefix, max_extra_len: int):
  """The most tokens each row's output may hold, EOS included: its source tokens (at least its
  prefix's tokens + 1, room for the prefix and EOS) + `max_extra_len`. inputs: [batch, src_len]
  ids, 0 on padding; prefix: None or [batch, P] ids then PAD. Returns [batch] int32."""
  limits = jnp.sum(inputs != PAD_ID, axis=-1, dtype=jnp.int32)
  if prefix is not None:
    limits = jnp.maximum(limits, jnp.sum(prefix != PAD_ID, axis=-1, dtype=jnp.int32) + 1)
  return limits + max_extra_len


def prefix_token(prefix, t):
  """The token `prefix` [batch, P] forces at step `t` ([], or [batch]: each entry at its own
  step): [batch] int32, PAD where nothing is forced (past a row's prefix)."""
  width = prefix.shape[1]
  at = jnp.minimum(t, width - 1)
  if jnp.ndim(t) == 0:
    tok = lax.dynamic_index_in_dim(prefix, at, axis=1, keepdims=False)
  else:
    tok = jnp.take_along_axis(prefix, at[:, None], axis=1)[:, 0]
  return jnp.where(t < width, tok, PAD_ID).astype(jnp.int32)


def write_step(seqs, tok, t):
  """`seqs` [batch, ..., max_len] with `tok` [batch, ...] written at step `t`: [] (one slice
  update) or [batch] (each entry at its own step)."""
  if jnp.ndim(t) == 0:
    return lax.dynamic_update_slice(seqs, tok[..., None], (0,) * (seqs.ndim - 1) + (t,))
  at = jnp.arange(seqs.shape[-1]) == t.reshape(t.shape + (1,) * (seqs.ndim - 1))
  return jnp.where(at, tok[..., None], seqs)


def _per_entry(x, ndim: int):
  """A per-entry quantity, [] or [batch], shaped to broadcast against [batch, ...] of `ndim`."""
  return x if jnp.ndim(x) == 0 else x.reshape(x.shape + (1,) * (ndim - 1))


def next_log_probs(
  logits,
  t,
  *,
  max_lens=None,
  prefix=None,
  keep: bool = True,
  eos_id: int = EOS_ID,
  beam: int | None = None,
):
  """The log-probabilities [batch, vocab] float32 a step draws from, for `logits` [batch, vocab]
  at step `t` ([] or [batch]); with `beam`, `logits` [batch*beam, vocab] -> [batch, beam, vocab]
  (beam search's rows, taken apart after the log-softmax).

  prefix: None or [batch, P]: at a step within its prefix, an entry's only token is the prefix's
  (keeping its log-probability, or at 0 without `keep`: model/search.py's prefix rules).
  max_lens: None or [batch]: at step t with t + 1 >= max_lens EOS is the only token, at 0 (a
  forced EOS costs nothing), whatever the prefix."""
  logp = distribution.log_probs(logits)
  if beam is not None:
    logp = logp.reshape(-1, beam, logp.shape[-1])
  if prefix is not None:
    logp = distribution.force(logp, _per_entry(prefix_token(prefix, t), logp.ndim - 1), keep)
  if max_lens is not None:
    eos_only = jnp.where(jnp.arange(logp.shape[-1]) == eos_id, 0.0, -jnp.inf)
    forced = t + 1 >= jnp.asarray(max_lens, jnp.int32)
    logp = jnp.where(_per_entry(forced, logp.ndim), eos_only, logp)
  return logp


class Tokens(NamedTuple):
  """Greedy search's and sampling's state: one hypothesis per row."""

  t: jax.Array  # [] steps taken ([batch]: each row its own)
  tok: jax.Array  # [batch] the last token (0, the start symbol, before the first)
  seqs: jax.Array  # [batch, max_len] the tokens so far, PAD after EOS
  done: jax.Array  # [batch] bool, EOS emitted
  total: jax.Array | None = None  # [batch] float32 summed log-probability (None: not kept)
  token_logp: jax.Array | None = None  # [batch, max_len] each token's (None: not kept)
  cache: Any = None  # the step function's (model/search.py), as the step left it


def start_tokens(
  batch_size: int, max_len: int, total: bool = False, token_logp: bool = False, cache=None
):
  """`Tokens` before the first step; `total`, `token_logp`: keep those scores."""
  return Tokens(
    t=jnp.int32(0),
    tok=jnp.zeros((batch_size,), jnp.int32),
    seqs=jnp.full((batch_size, max_len), PAD_ID, jnp.int32),
    done=jnp.zeros((batch_size,), bool),
    total=jnp.zeros((batch_size,), jnp.float32) if total else None,
    token_logp=jnp.zeros((batch_size, max_len), jnp.float32) if token_logp else None,
    cache=cache,
  )


def token_advance(s: Tokens, logp, choose, eos_id: int = EOS_ID) -> Tokens:
  """One step of greedy search or sampling: each row's token `choose(logp)` ([batch, vocab]
  -> [batch]) from `next_log_probs`' `logp`, PAD once the row is done, its log-probability
  added to the scores kept (0 once done)."""
  tok = choose(logp).astype(jnp.int32)
  scores = {}
  if s.total is not None or s.token_logp is not None:
    gain = jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]
    gain = jnp.where(s.done, 0.0, gain)
    if s.total is not None:
      scores["total"] = s.total + gain
    if s.token_logp is not None:
      scores["token_logp"] = write_step(s.token_logp, gain, s.t)
  tok = jnp.where(s.done, PAD_ID, tok)
  seqs = write_step(s.seqs, tok, s.t)
  return s._replace(t=s.t + 1, tok=tok, seqs=seqs, done=s.done | (tok == eos_id), **scores)
