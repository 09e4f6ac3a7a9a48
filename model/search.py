"""Autoregressive search over a decoder step function: greedy, sampling and beam search.

All functions are pure and jit-able (``batch_size``, ``max_len``, ``beam_size``,
``top_k`` and ``eos_id`` must be static); time steps run in ``lax.while_loop``.

Step function contract::

    step_fn(ids, cache) -> (logits, cache)

* ``ids``: ``[n, 1]`` int32, the previous token of each of the ``n`` live
  sequences; the first step gets ``0``, the decoder's start symbol (targets are
  shifted right with 0 = PAD).
* ``logits``: ``[n, vocab]``, any float dtype; log-softmax is taken in float32.
* ``cache``: any pytree (may be empty). Every leaf of rank >= 1 has leading
  dimension ``n``; rank-0 leaves (e.g. a shared decode index) are passed
  through untouched when beams are expanded or reordered. The structure,
  shapes and dtypes must be the same before and after a step.

Growing caches (``grow``, ``segment``): a cache whose buffers have one slot per generated
position need not be allocated for ``max_len`` up front. With ``grow`` given, the cache is
sized for the first ``segment`` steps and the loop runs in segments: ``segment`` steps, then
segments doubling in length up to ``max_len`` (``_segment_ends``); between segments
``grow(cache, extra)`` must return the cache with room for ``extra`` more positions. Each step
then reads (and beam search reorders) only the buffer allocated so far, not the whole
``max_len``; each segment is one more compiled loop.

Output convention: ``ids`` rows hold the generated tokens (the start symbol is
not included); after a row's EOS every position is PAD, and a row that never
emits EOS runs to ``max_len`` without one.

The three searches share the time loop, its segments and the step contract, so they are one
module; what one step draws from and how greedy search and sampling take their token is
model/token_step.py's, shared with the pool (model/pool.py), which also runs beam search's step
and result (``beam_advance``, ``beam_best``) with every sentence at its own step.

``max_lens`` (optional, ``[batch]`` int): per-sentence maximum number of
generated tokens *including* EOS. At step ``t`` (0-based) a sentence with
``t + 1 >= max_lens`` is forced to emit EOS, so its row has at most
``max_lens`` non-PAD tokens, the last being EOS (beam search with the 'fairseq' penalty ends
one step earlier, its last tokens not always EOS: below). Values above ``max_len`` have
no effect (the global ``max_len`` truncates without EOS); values below 1 act as 1.

``prefix`` (optional, ``[batch, P]`` int32): a target prefix per sentence, its tokens then PAD
(no EOS; a row of PAD forces nothing). At each step ``t`` within its prefix a sentence's token is
``prefix[:, t]`` (``token_step.next_log_probs``), and every search goes on from the prefix's end
as from its own tokens. Beam search keeps one live hypothesis through the prefix. ``prefix_rule``
'forced' (the default): the forced tokens keep their log-probabilities, so scores and per-token
scores count the prefix as forced decoding does. 'ctranslate2': CTranslate2's ``target_prefix``
rules, so that its exports translate alike: the forced tokens count 0 (a score is the
continuation's log-probability, over the whole hypothesis' length penalty), and at a sentence's
first step after its prefix beam search keeps EOS only where it is the best token (CTranslate2
drops EOS from all candidates but the first there; an empty prefix in a given ``prefix`` too, as
there). The forced EOS of ``max_lens`` wins over a prefix: give room for it (model/generate.py
does).

Beam search (``beam_search``, ``beam_advance``):

Scoring: a hypothesis of ``len`` generated tokens, *counting its EOS*, with summed
log-probability ``logp`` scores ``logp / ((5 + len) / 6) ** alpha``. E.g. ``[a, b, EOS]``
has ``len = 3``; a hypothesis forced to finish by ``max_lens`` counts the forced EOS,
which itself costs log-prob 0 (the 'fairseq' penalty ends a step earlier: below). A hypothesis
still live at ``max_len`` (no EOS) has ``len = max_len``.

Each step expands every live beam over the vocabulary and takes the top ``2*beam``
candidates; without a prefix, from the logits themselves (``top_k.log_softmax_top_k``: the
values and ties of the written-out log-probabilities), which step functions hand over with
their impossible ids at -inf (model/decoder_state.py `cached_step`). EOS candidates ranked
within the top ``beam`` (i.e. ones that would occupy a beam) move to the finished set, which
keeps the ``beam`` best scores; the live set is the top ``beam`` non-EOS candidates (there are
always enough among ``2*beam``).
With the 'exact' stopping rule (GNMT's default) a batch entry is done, and its finished set
frozen, once the set is full and the best live ``logp`` divided by the largest length penalty
it can still get (at most ``min(max_lens, max_len)`` tokens) cannot beat the worst finished
score, or once no live beam is left; with 'finished' (fairseq's default) as soon as ``beam``
hypotheses have finished (or no live beam is left). With ``beam_size == 1`` an entry is done
as soon as its hypothesis finishes, so the result equals ``greedy_search`` exactly for any
``alpha`` (with the 'fairseq' penalty, but for the EOS greedy search forces after a sentence's
length limit: see below). The loop ends when every entry is done or at ``max_len``; an entry
with fewer than ``beam`` finished hypotheses is then filled with the best live ones (scored as
above).

``penalty='fairseq'`` scores ``logp / len ** alpha`` (``len`` counting the EOS) and by default
stops by 'finished', as fairseq and CTranslate2 (patience 1) decide: no bound on what a live
hypothesis might still reach, so a large ``alpha`` does not keep every sentence searching to
its length limit ('exact' would: under ``len ** alpha`` a longer hypothesis gains more). Either
rule works with either penalty; 'finished' stops no later than 'exact' and returns the finished
set 'exact' held at that step (which 'exact' can only improve on). The two penalties agree at
``alpha=0``. At its length limit a sentence ends as CTranslate2 ends it under this penalty: at
its last step with a token to choose (``t + 2 >= max_lens``) every candidate within the top
``beam`` finishes, EOS or not (one without EOS has ``len = t + 1`` tokens), and the sentence is
done; no EOS is forced after it, whose free step would make a longer ``len`` (under
``len ** alpha``) of the same ``logp``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from model import distribution
from model.indices import divmod_index, take_along
from model.search_settings import PENALTIES, check_prefix_rule, stopping_rule
from model.special_tokens import EOS_ID, PAD_ID
from model.token_step import (
  Tokens,
  next_log_probs,
  start_tokens,
  token_advance,
  write_step,
)
from model.top_k import beams_top_k, log_softmax_top_k

__all__ = [
  "PAD_ID",
  "EOS_ID",
  "length_penalty",
  "expand_to_beams",
  "gather_beams",
  "beam_rows",
  "greedy_search",
  "sample",
  "beam_search",
  "beam_start",
  "beam_advance",
  "beam_best",
  "beam_resume",
  "pause_steps",
]

NEG_INF = float("-inf")

StepFn = Callable[[jax.Array, Any], tuple[jax.Array, Any]]


def length_penalty(length, alpha, penalty: str = "gnmt"):
  """The divisor of a hypothesis' summed log-probability, in float32 (any shape): GNMT's
  ``((5 + length) / 6) ** alpha`` (the paper's), or fairseq's and CTranslate2's
  ``length ** alpha`` (``penalty='fairseq'``). ``alpha`` a number or a traced scalar (one
  compiled search for every alpha); the same values either way.

  Handed out through ``lax.optimization_barrier``, so that a score divided by it is a true
  division whatever ``alpha`` is: XLA rewrites ``x / l ** alpha`` as ``x * l ** -alpha`` (other
  last bits) unless it can fold a constant ``alpha`` of 0, 1 or 2 (docs/experiments.md)."""
  length = jnp.asarray(length, jnp.float32)
  if penalty == "fairseq":
    return lax.optimization_barrier(length**alpha)
  return lax.optimization_barrier(((5.0 + length) / 6.0) ** alpha)


def map_batched(fn, tree):
  """Applies ``fn`` to every leaf of rank >= 1; rank-0 leaves pass through."""
  return jax.tree_util.tree_map(lambda x: x if jnp.ndim(x) == 0 else fn(x), tree)


def expand_to_beams(tree, beam_size: int):
  """Repeats each batch row ``beam_size`` times: leaves ``[batch, ...]`` -> ``[batch*beam, ...]``.

  Row ``b * beam_size + j`` is beam ``j`` of batch entry ``b``. Rank-0 leaves pass through.
  """
  return map_batched(lambda x: jnp.repeat(x, beam_size, axis=0), tree)


def gather_beams(tree, indices, batch: int, beam: int):
  """Reorders beams within each batch entry.

  Args:
    tree: pytree, leaves ``[batch*beam, ...]`` (beam-major within a batch entry,
      as made by ``expand_to_beams``); rank-0 leaves pass through.
    indices: ``[batch, new_beam]`` int, source beam in ``[0, beam)`` for each new beam.
  Returns:
    the tree with leaves ``[batch*new_beam, ...]``; new row ``b*new_beam + j`` is
    old row ``b*beam + indices[b, j]``.
  """
  flat = beam_rows(indices, batch, beam)
  return map_batched(lambda x: x[flat], tree)


def beam_rows(indices, batch: int, beam: int):
  """``gather_beams``'s source rows: ``[batch*new_beam]``, new row ``b*new_beam + j`` from old
  row ``b*beam + indices[b, j]``."""
  return (indices + jnp.arange(batch, dtype=indices.dtype)[:, None] * beam).reshape(-1)


def _take_beams(x, indices):
  """``x`` ``[batch, beam, ...]``, ``indices`` ``[batch, new]`` -> ``[batch, new, ...]``."""
  idx = indices.reshape(indices.shape + (1,) * (x.ndim - 2))
  return take_along(x, idx, axis=1)


def _segment_ends(max_len: int, segment: int | None, grow) -> list[int]:
  """Step counts at which the loop pauses to grow the cache: ``segment``, then twice as far
  each time (``2*segment``, ``4*segment``, ...), then ``max_len``, a last stretch shorter than
  ``segment`` joined to the one before (just ``[max_len]`` without ``grow``). Each segment is
  one more loop to trace and compile; doubling keeps them few for long limits, which outputs
  seldom reach."""
  if segment is not None and segment < 1:
    raise ValueError(f"search: segment must be positive, got {segment}")
  if grow is None or segment is None or segment >= max_len:
    return [max_len]
  ends = [segment]
  while 2 * ends[-1] < max_len:
    ends.append(2 * ends[-1])
  if len(ends) > 1 and max_len - ends[-1] < segment:
    ends.pop()
  return ends + [max_len]


def segmented_loop(cond, body, state, max_len, segment, grow, start: int = 0, until=None):
  """``lax.while_loop(cond, body, state)`` run as one loop per segment of steps, growing
  ``state.cache`` by each segment's length in between (see module doc); ``state.t`` counts the
  steps. ``start``, ``until`` (static): only the segments after step ``start`` up to step
  ``until`` (segment ends, or 0 and ``max_len``; any steps without ``grow``; None: ``max_len``),
  for a search run in pieces (``beam_resume``): the cache then holds ``start`` positions (all
  ``max_len`` without ``grow``). A piece from a pause to ``max_len`` grows the cache to every
  position at once and runs one loop, whatever segment ends it spans: a search's last piece,
  which few sentences reach, compiles one loop."""
  ends = _segment_ends(max_len, segment, grow)
  until = max_len if until is None else until
  if grow is None and (start, until) != (0, max_len):  # nothing to grow: pause anywhere
    return lax.while_loop(lambda s: cond(s) & (s.t < until), body, state)
  if until not in ends or (start and start not in ends):
    raise ValueError(f"search: steps {start}..{until} do not fall on the segment ends {ends}")
  if start and until == max_len:  # a last piece: all its positions at once, one loop
    state = state._replace(cache=grow(state.cache, max_len - start))
    return lax.while_loop(lambda s: cond(s) & (s.t < max_len), body, state)
  for i, end in enumerate(ends):
    if end <= start or end > until:
      continue
    if i:
      state = state._replace(cache=grow(state.cache, end - ends[i - 1]))
    state = lax.while_loop(lambda s, end=end: cond(s) & (s.t < end), body, state)
  return state


def pause_steps(max_len: int, segment: int | None) -> list[int]:
  """The segment ends before ``max_len`` (``_segment_ends`` of a growing cache): where a search
  run in pieces (``beam_resume``) may pause without a loop more than one search in one piece
  compiles."""
  return _segment_ends(max_len, segment, True)[:-1]


def _decode(
  step_fn: StepFn,
  cache,
  batch_size: int,
  max_len: int,
  choose,
  *,
  eos_id: int,
  max_lens,
  grow,
  segment,
  scores: bool,
  prefix,
  prefix_rule: str,
):
  """Shared loop of greedy/sampling; ``choose(logp [batch, vocab], t) -> [batch]`` tokens. With
  ``scores``: (ids, summed log-probabilities [batch], per-token ones [batch, max_len])."""
  keep = check_prefix_rule(prefix_rule) == "forced"

  def cond(s: Tokens):
    return (s.t < max_len) & ~jnp.all(s.done)

  def body(s: Tokens):
    logits, cache = step_fn(s.tok[:, None], s.cache)
    logp = next_log_probs(logits, s.t, max_lens=max_lens, prefix=prefix, keep=keep, eos_id=eos_id)
    return token_advance(s, logp, lambda logp: choose(logp, s.t), eos_id)._replace(cache=cache)

  s = start_tokens(batch_size, max_len, scores, scores, cache)
  s = segmented_loop(cond, body, s, max_len, segment, grow)
  return (s.seqs, s.total, s.token_logp) if scores else s.seqs


def greedy_search(
  step_fn: StepFn,
  cache,
  batch_size: int,
  max_len: int,
  *,
  eos_id: int = EOS_ID,
  max_lens=None,
  grow=None,
  segment=None,
  scores: bool = False,
  prefix=None,
  prefix_rule: str = "forced",
):
  """Argmax decoding; stops early once every sequence has emitted EOS.

  Args:
    cache: pytree with leaves ``[batch, ...]`` (or rank 0).
    max_lens: optional ``[batch]`` per-sentence maximum length (see module doc).
    grow, segment: a cache sized for ``segment`` steps and how to enlarge it (module doc).
    scores: also return the log-probabilities of the tokens chosen.
    prefix, prefix_rule: optional ``[batch, P]`` target prefixes and how they count (module
      doc).
  Returns:
    ids ``[batch, max_len]`` int32, PAD after EOS; with ``scores``, (ids, their summed
    log-probability ``[batch]`` float32, each token's ``[batch, max_len]``), an EOS forced by
    ``max_lens`` counting 0 (as in beam search) and 0 after the last token.
  """
  # Argmax of the float32 log-probs (not the raw logits) so ties break exactly
  # as in beam search; beam_size=1 reproduces this function.
  loop = dict(eos_id=eos_id, max_lens=max_lens, grow=grow, segment=segment, scores=scores)
  argmax = lambda logp, t: distribution.choose(logp)
  return _decode(
    step_fn, cache, batch_size, max_len, argmax, **loop, prefix=prefix, prefix_rule=prefix_rule
  )


def sample(
  step_fn: StepFn,
  cache,
  rng,
  batch_size: int,
  max_len: int,
  *,
  temperature=1.0,
  top_k: int = 0,
  eos_id: int = EOS_ID,
  max_lens=None,
  grow=None,
  segment=None,
  scores: bool = False,
  prefix=None,
  prefix_rule: str = "forced",
):
  """Ancestral sampling from ``softmax(logits / temperature)``, optionally over the top-k only.

  Step ``t`` uses ``jax.random.fold_in(rng, t)``, so the output is a deterministic
  function of ``rng``. ``top_k=0`` samples from the full vocabulary; ``top_k=1``
  (or a Python ``temperature == 0``) equals ``greedy_search``. ``prefix`` and ``prefix_rule``
  as the module doc says (its tokens forced, whatever the temperature).

  Returns:
    ids ``[batch, max_len]`` int32, PAD after EOS; with ``scores`` as ``greedy_search``'s (the
    log-probabilities of the untempered distribution).
  """
  loop = dict(eos_id=eos_id, max_lens=max_lens, grow=grow, segment=segment, scores=scores)
  loop.update(prefix=prefix, prefix_rule=prefix_rule)
  if isinstance(temperature, (int, float)) and temperature == 0:
    return greedy_search(step_fn, cache, batch_size, max_len, **loop)

  def choose(logp, t):
    return distribution.choose(logp, jax.random.fold_in(rng, t), temperature, top_k)

  return _decode(step_fn, cache, batch_size, max_len, choose, **loop)


class _BeamState(NamedTuple):
  t: jax.Array  # [] steps taken = tokens generated per live hypothesis ([batch]: per entry)
  tok: jax.Array  # [batch, beam] last token of each live hypothesis
  live_seqs: jax.Array  # [batch, beam, max_len]
  live_logp: jax.Array  # [batch, beam] summed log-probs, sorted descending; -inf = dead
  cache: Any  # leaves [batch*beam, ...]
  fin_seqs: jax.Array  # [batch, beam, max_len]
  fin_scores: jax.Array  # [batch, beam] length-normalised, sorted descending; -inf = empty
  fin_flags: jax.Array  # [batch, beam] bool, slot holds a finished hypothesis
  done: jax.Array  # [batch] bool, finished set frozen
  # With token scores only (None otherwise): each hypothesis' per-step log-probabilities.
  live_tokp: jax.Array | None = None  # [batch, beam, max_len] float32, 0 after the last token
  fin_tokp: jax.Array | None = None  # [batch, beam, max_len]
  # With count_steps only (None otherwise): the steps each entry searched before it was done,
  # and the steps its rows were computed (all of its loop's, unless model/live_chunks.py skips it).
  searched: jax.Array | None = None  # [batch] int32
  computed: jax.Array | None = None  # [batch] int32


def _per_entry(x):
  """A quantity per batch entry, [] (the same for all) or [batch], as [] or [batch, 1]."""
  return x if jnp.ndim(x) == 0 else x[:, None]


def beam_start(
  batch_size: int,
  beam_size: int,
  max_len: int,
  cache=None,
  token_scores: bool = False,
  count_steps: bool = False,
) -> _BeamState:
  """The beam search state before its first step (``cache`` as given: expand it first); with
  ``token_scores`` it tracks each hypothesis' per-token log-probabilities too, with
  ``count_steps`` the steps each entry searches before it is done and those it is computed."""
  b, k = batch_size, beam_size
  seqs0 = jnp.full((b, k, max_len), PAD_ID, jnp.int32)
  tokp0 = jnp.zeros((b, k, max_len), jnp.float32) if token_scores else None
  return _BeamState(
    t=jnp.int32(0),
    tok=jnp.zeros((b, k), jnp.int32),  # start symbol
    live_seqs=seqs0,
    # All beams start identical: only beam 0 is alive so the first step expands it once.
    live_logp=jnp.tile(jnp.array([0.0] + [NEG_INF] * (k - 1), jnp.float32), (b, 1)),
    cache=cache,
    fin_seqs=seqs0,
    fin_scores=jnp.full((b, k), NEG_INF, jnp.float32),
    fin_flags=jnp.zeros((b, k), bool),
    done=jnp.zeros((b,), bool),
    live_tokp=tokp0,
    fin_tokp=tokp0,
    searched=jnp.zeros((b,), jnp.int32) if count_steps else None,
    computed=jnp.zeros((b,), jnp.int32) if count_steps else None,
  )


class _Candidates(NamedTuple):
  """A beam step's top ``2*beam`` continuations of each batch entry, best first: their summed
  log-probabilities, the beams they continue, their tokens, the sequences (and, when tracked,
  per-token log-probabilities) they make, and which end in EOS."""

  logp: jax.Array  # [batch, 2k]; -inf: dropped by the 'ctranslate2' prefix rule
  source: jax.Array  # [batch, 2k] the live beam each continues
  tok: jax.Array  # [batch, 2k]
  seqs: jax.Array  # [batch, 2k, max_len]
  tokp: jax.Array | None  # [batch, 2k, max_len]
  is_eos: jax.Array  # [batch, 2k]
  dropped: jax.Array | None  # [batch, 2k] EOS candidates the prefix rule drops (None: no rule)


def _candidates(s: _BeamState, logp, eos_id: int, prefix, keep: bool) -> _Candidates:
  """The top ``2*beam`` continuations of ``s``'s live beams under ``logp`` ``[batch, beam,
  vocab]`` (``next_log_probs``); ties go to the lower (beam, token). Without ``keep`` (the
  'ctranslate2' prefix rule), at a sentence's first step after its prefix an EOS candidate below
  the best is dropped: it can neither finish nor live on."""
  b, k, vocab = logp.shape
  t = s.t
  vals, flat = beams_top_k(s.live_logp[:, :, None] + logp, 2 * k)  # [b, 2k]
  dropped = None
  if prefix is not None and not keep:
    first = jnp.asarray(t) == jnp.sum(prefix != PAD_ID, axis=1)  # [b]
    dropped = first[:, None] & (flat % vocab == eos_id) & (jnp.arange(2 * k) > 0)
  gain = None
  if s.live_tokp is not None:  # each candidate's own token log-probability
    gain = jnp.take_along_axis(logp.reshape(b, k * vocab), flat, axis=1)  # [b, 2k]
  return _candidate_paths(s, vals, flat, vocab, gain, eos_id, dropped)


def _candidate_paths(s: _BeamState, vals, flat, vocab: int, gain, eos_id: int, dropped=None):
  """`_Candidates` of the top ``2*beam`` (``vals``, ``flat`` indices into ``beam * vocab``), their
  tokens written at step ``s.t``, as are their own log-probabilities ``gain`` when tracked."""
  src, tok = divmod_index(flat, vocab)
  is_eos = tok == eos_id
  if dropped is not None:
    is_eos, vals = is_eos & ~dropped, jnp.where(dropped, NEG_INF, vals)
  tokp = None
  if s.live_tokp is not None:
    tokp = write_step(_take_beams(s.live_tokp, src), gain, s.t)
  seqs = write_step(_take_beams(s.live_seqs, src), tok, s.t)
  return _Candidates(vals, src, tok, seqs, tokp, is_eos, dropped)


def _candidates_of_logits(s: _BeamState, logits, max_lens, eos_id: int) -> _Candidates:
  """``_candidates`` of ``next_log_probs(logits, s.t, max_lens=max_lens, beam=beam)`` (no prefix),
  identical, without the log-softmax written out (``top_k.log_softmax_top_k``)."""
  b, k = s.tok.shape
  # The step's logits come masked (model/decoder_state.py `cached_step`): a mask written here
  # would be copied by XLA:CPU for each of their readers.
  x = logits.astype(jnp.float32).reshape(b, k, -1)
  forced = None
  if max_lens is not None:  # at the length limit EOS is the only token
    at_limit = jnp.broadcast_to(s.t + 1 >= jnp.asarray(max_lens, jnp.int32), (b,))
    forced = jnp.broadcast_to(at_limit[:, None], (b, k))
  vals, flat, gain = log_softmax_top_k(x, s.live_logp, 2 * k, only=forced, only_id=eos_id)
  return _candidate_paths(s, vals, flat, x.shape[-1], gain, eos_id)


def _finish(s: _BeamState, c: _Candidates, lp_now, last=None):
  """The finished set after a step: EOS candidates among the top ``beam`` (scored by ``lp_now``,
  the length penalty at this step's length), and every one of them in the entries at their
  ``last`` step ([batch] bool, or None), merged with ``s``'s; the best ``beam`` kept.
  Returns (scores, flags, seqs, per-token log-probabilities or None)."""
  k = s.tok.shape[1]
  ends = c.is_eos[:, :k] if last is None else c.is_eos[:, :k] | last[:, None]
  new_fin = ends & (c.logp[:, :k] > NEG_INF) & ~s.done[:, None]
  new_scores = jnp.where(new_fin, c.logp[:, :k] / lp_now, NEG_INF)
  all_scores = jnp.concatenate([s.fin_scores, new_scores], axis=1)
  all_flags = jnp.concatenate([s.fin_flags, new_fin], axis=1)
  scores, best = lax.top_k(jnp.where(all_flags, all_scores, NEG_INF), k)
  flags = take_along(all_flags, best, axis=1)
  seqs = _take_beams(jnp.concatenate([s.fin_seqs, c.seqs[:, :k]], axis=1), best)
  tokp = None
  if c.tokp is not None:
    tokp = _take_beams(jnp.concatenate([s.fin_tokp, c.tokp[:, :k]], axis=1), best)
  return scores, flags, seqs, tokp


def _live(c: _Candidates, k: int):
  """(summed log-probabilities [batch, beam], candidate indices [batch, beam]) of the next live
  beams: the best ``k`` non-EOS candidates, or with a dropped candidate (``c.dropped``) the first
  ``k`` non-EOS ones by rank, the dropped dead in their slots."""
  if c.dropped is None:
    return lax.top_k(jnp.where(c.is_eos, NEG_INF, c.logp), k)
  rank = -jnp.arange(c.logp.shape[1], dtype=c.logp.dtype)
  _, pick = lax.top_k(jnp.where(c.is_eos, NEG_INF, rank), k)
  live_logp, order = lax.top_k(take_along(c.logp, pick, axis=1), k)
  return live_logp, take_along(pick, order, axis=1)


def _stops(live_logp, fin_scores, fin_flags, t, lmax, alpha, penalty: str, rule):
  """[batch] bool: whether each entry is done after this step by the stopping ``rule`` (module
  doc; or a traced bool, 'finished' where true); ``t`` the steps taken before it, ``lmax`` the
  longest reachable length."""
  full = jnp.all(fin_flags, axis=1)
  finished = full | (live_logp[:, 0] == NEG_INF)
  if live_logp.shape[1] == 1 or (isinstance(rule, str) and rule == "finished"):
    return finished
  # logp <= 0, so logp / lp(L) is largest at the largest reachable lp(L).
  best_lp = jnp.maximum(length_penalty(t + 2, alpha, penalty), length_penalty(lmax, alpha, penalty))
  worst = jnp.where(full, fin_scores[:, -1], NEG_INF)
  exact = live_logp[:, 0] / best_lp <= worst
  return exact if isinstance(rule, str) else jnp.where(rule, finished, exact)


def beam_advance(
  s: _BeamState,
  logits,
  *,
  alpha,
  penalty: str = "gnmt",
  stopping: str | None = None,
  eos_id: int = EOS_ID,
  max_lens=None,
  max_len: int,
  prefix=None,
  prefix_rule: str = "forced",
):
  """One step of ``beam_search`` on the step function's ``logits`` ``[batch*beam, vocab]``:
  the new state (its ``cache`` left as it was) and, per new beam, the beam it continues
  (``[batch, beam]``, for ``gather_beams`` of the cache). ``s.t`` may be ``[batch]``, every
  entry at its own step (continuous batching, model/pool.py); ``stopping``, ``prefix``
  (``[batch, P]``) and ``prefix_rule`` as ``beam_search``'s."""
  b, k = s.tok.shape
  t = s.t
  keep = check_prefix_rule(prefix_rule) == "forced"
  if prefix is None:
    c = _candidates_of_logits(s, logits, max_lens, eos_id)
  else:
    logp = next_log_probs(
      logits, t, max_lens=max_lens, prefix=prefix, keep=keep, eos_id=eos_id, beam=k
    )
    c = _candidates(s, logp, eos_id, prefix, keep)
  limits = None if max_lens is None else jnp.asarray(max_lens, jnp.int32)
  last = None  # the 'fairseq' penalty's entries at their last step: CTranslate2's rule
  if penalty == "fairseq" and limits is not None:
    last = jnp.broadcast_to(t + 2 >= limits, (b,))
  fin_scores, fin_flags, fin_seqs, fin_tokp = _finish(
    s, c, _per_entry(length_penalty(t + 1, alpha, penalty)), last
  )
  live_logp, pick = _live(c, k)
  tracked = {}
  if c.tokp is not None:
    tracked = dict(live_tokp=_take_beams(c.tokp, pick), fin_tokp=fin_tokp)
  if s.searched is not None:
    tracked["searched"] = s.searched + (~s.done).astype(jnp.int32)
  if s.computed is not None:
    tracked["computed"] = s.computed + 1
  lmax = max_len if limits is None else jnp.minimum(limits, max_len)
  rule = stopping_rule(penalty, stopping)
  stop = _stops(live_logp, fin_scores, fin_flags, t, lmax, alpha, penalty, rule)
  if last is not None:
    stop = stop | last
  state = _BeamState(
    t + 1,
    take_along(c.tok, pick, axis=1),
    _take_beams(c.seqs, pick),
    live_logp,
    s.cache,
    fin_seqs,
    fin_scores,
    fin_flags,
    s.done | stop,
    **tracked,
  )
  return state, take_along(c.source, pick, axis=1)


def beam_best(s: _BeamState, alpha, penalty: str = "gnmt"):
  """``beam_search``'s result from its state: ids ``[batch, beam, max_len]`` and scores
  ``[batch, beam]``, best first, and, when the state tracks them (``beam_start``'s
  ``token_scores``), the hypotheses' per-token log-probabilities ``[batch, beam, max_len]``
  (0 after the last token); an entry with fewer than ``beam`` finished hypotheses is filled
  with its best live ones, scored at its ``s.t`` tokens."""
  k = s.tok.shape[1]
  live_scores = s.live_logp / _per_entry(length_penalty(s.t, alpha, penalty))
  scores = jnp.concatenate([s.fin_scores, live_scores], axis=1)  # [b, 2k]
  is_fin = jnp.concatenate([s.fin_flags, jnp.zeros(s.fin_flags.shape, bool)], axis=1)
  seqs = jnp.concatenate([s.fin_seqs, s.live_seqs], axis=1)
  # Finished first (best first), then live (best first); keep k; sort by score.
  chosen = jnp.lexsort((-scores, ~is_fin), axis=-1)[:, :k]
  scores = jnp.take_along_axis(scores, chosen, axis=1)
  order = jnp.argsort(-scores, axis=1, stable=True)
  chosen = jnp.take_along_axis(chosen, order, axis=1)
  best = _take_beams(seqs, chosen), jnp.take_along_axis(scores, order, axis=1)
  if s.live_tokp is None:
    return best
  return *best, _take_beams(jnp.concatenate([s.fin_tokp, s.live_tokp], axis=1), chosen)


def beam_search(
  step_fn: StepFn,
  cache,
  batch_size: int,
  max_len: int,
  *,
  beam_size: int = 4,
  alpha=0.6,
  penalty: str = "gnmt",
  stopping: str | None = None,
  eos_id: int = EOS_ID,
  max_lens=None,
  grow=None,
  segment=None,
  token_scores: bool = False,
  prefix=None,
  prefix_rule: str = "forced",
  count_steps: bool = False,
  reorder=None,
):
  """Beam search with the GNMT length penalty (Wu et al. 2016; Vaswani et al. 2017), or with
  fairseq's and CTranslate2's (``penalty='fairseq'``): how it scores, steps and stops is the
  module doc's "Beam search".

  Args:
    step_fn: see module doc; called with ``n = batch * beam_size``.
    cache: pytree with leaves ``[batch, ...]`` (or rank 0); expanded here to
      ``[batch * beam_size, ...]`` with ``expand_to_beams``.
    alpha: length-penalty exponent (0 = plain log-prob).
    penalty: 'gnmt' or 'fairseq': the length penalty's form (above).
    stopping: 'exact' or 'finished': when an entry is done (above); None: the penalty's own;
      a traced bool (true: 'finished'): one program for both rules.
    max_lens: optional ``[batch]`` per-sentence maximum length (see module doc).
    grow, segment: a cache sized for ``segment`` steps and how to enlarge it (module doc).
    token_scores: also return each hypothesis' per-token log-probabilities.
    prefix: optional ``[batch, P]`` target prefixes (module doc): every hypothesis of a sentence
      starts with its prefix, whose log-probability its score counts ('forced' ``prefix_rule``)
      or not ('ctranslate2').
    count_steps: also return, last, ``[batch]`` int32: the steps each entry searched before it
      was done (the loop runs ``max`` of them for the whole batch).
    reorder: how the cache's beams are reordered each step (``gather_beams``'s signature; None:
      ``gather_beams``), e.g. model/ancestry.py's for a cache kept in place.
  Returns:
    ids ``[batch, beam, max_len]`` int32 (PAD after EOS) and scores ``[batch, beam]``
    float32, sorted best first. Slots with no hypothesis at all (only possible when
    fewer than ``beam`` distinct ones exist) have score ``-inf``. With ``token_scores``, a
    third array ``[batch, beam, max_len]`` float32: the log-probability of each token under
    the step function's distribution (a forced EOS counting 0; 0 after the last token), which
    sum to the score's log-probability before the length penalty.
  """
  b, k = batch_size, beam_size
  if penalty not in PENALTIES:
    raise ValueError(f"beam_search: penalty={penalty!r} is not one of {PENALTIES}")
  rules = dict(alpha=alpha, penalty=penalty, stopping=stopping, eos_id=eos_id, max_lens=max_lens)
  body, cond = _beam_loop(
    step_fn, b, k, max_len, reorder, prefix=prefix, prefix_rule=prefix_rule, **rules
  )
  s = beam_start(b, k, max_len, expand_to_beams(cache, k), token_scores, count_steps)
  s = segmented_loop(cond, body, s, max_len, segment, grow)
  best = beam_best(s, alpha, penalty)
  return (*best, s.searched) if count_steps else best


def _beam_loop(step_fn: StepFn, b: int, k: int, max_len: int, reorder=None, **rules):
  """(body, cond) of beam search's step loop over ``b`` entries of ``k`` beams, the cache
  reordered by ``reorder`` (None: ``gather_beams``); ``rules``: ``beam_advance``'s keywords."""
  reorder = reorder or gather_beams
  rules = dict(rules, stopping=stopping_rule(rules["penalty"], rules.get("stopping")))

  def body(s: _BeamState) -> _BeamState:
    logits, cache = step_fn(s.tok.reshape(b * k, 1), s.cache)
    s, parents = beam_advance(s, logits, max_len=max_len, **rules)
    return s._replace(cache=reorder(cache, parents, b, k))

  def cond(s: _BeamState):
    return (s.t < max_len) & ~jnp.all(s.done)

  return body, cond


def beam_resume(
  step_fn: StepFn,
  s: _BeamState,
  max_len: int,
  *,
  start: int,
  until: int,
  grow=None,
  segment=None,
  alpha=0.6,
  penalty: str = "gnmt",
  stopping: str | None = None,
  eos_id: int = EOS_ID,
  max_lens=None,
  reorder=None,
):
  """``beam_search``'s steps from state ``s`` at step ``start`` (``beam_start``'s state, its
  cache expanded, at 0) until step ``until`` (static, both segment ends or 0 and ``max_len``:
  ``segmented_loop``), every entry is done, or ``max_len``; the other arguments as
  ``beam_search``'s (no prefix). Searching 0 -> a -> b -> ``max_len`` in such pieces takes the
  same steps, over the same rows, as one ``beam_search``; ``beam_best`` of the last state is its
  result."""
  b, k = s.tok.shape
  rules = dict(alpha=alpha, penalty=penalty, stopping=stopping, eos_id=eos_id, max_lens=max_lens)
  body, cond = _beam_loop(step_fn, b, k, max_len, reorder, **rules)
  return segmented_loop(cond, body, s, max_len, segment, grow, start, until)
