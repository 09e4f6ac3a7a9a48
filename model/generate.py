"""The search of a trained model, as one pure function: encode once, then greedy, sampled or beam
search, with the search's own scores on request.

    ids = generate(model, params, inputs, rng, settings, max_decode_len)  # [batch, max_decode_len]
    ids, scores, token_scores = generate(..., outputs="token_scores")
    ids = generate(..., prefix=prefix)  # prefix [batch, P]: each row's output starts with it

`model` is any module made by `model.build.build_model` (it offers `encode`, `init_cache`,
`decode_step`); model/decoder_state.py turns it into the step function and cache that the
searches of model/search.py run on, and model/distribution.py says what they draw from. Source
rows are token ids ending in EOS, padded with 0. Output rows hold the generated tokens up to and
including EOS, then PAD; a row cut by `max_decode_len` has no EOS. The decoder never emits PAD
(its logit is masked), so PAD only ever means "after EOS". A target prefix (model/search.py) is
forced token by token and is part of the output (and of its scores), as CTranslate2's
`target_prefix`.

`inference.generator.Generator` compiles this function and owns its programs.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from model import ancestry, marian_beam, search
from model.decoder_state import (
  DECODE_SEGMENT,
  decoder_state,
  ensemble_decoder_state,
  only_ids_below,
)
from model.search_settings import MARIAN, SearchSettings
from model.special_tokens import EOS_ID, PAD_ID
from model.token_step import output_limits

OUTPUTS = ("ids", "scores", "token_scores")  # what a search program returns, cumulatively


class NBest(NamedTuple):
  """One sentence's hypotheses as the search found them, best first: `ids` each's tokens (no
  EOS, no PAD); `scores` [n] float32 the search's own scores (beam search's log-probability
  over the length penalty, greedy search's and sampling's log-probability; an EOS forced at the
  length limit costs 0); `token_scores` each's per-token log-probabilities, EOS last (but for a
  beam search's hypothesis that the 'fairseq' penalty ended at its length limit, model/search.py;
  None unless asked for)."""

  ids: list[np.ndarray]
  scores: np.ndarray
  token_scores: list[np.ndarray] | None = None


def generate(
  model,
  params,
  inputs,
  rng,
  settings: SearchSettings,
  max_decode_len: int,
  outputs: str = "ids",
  *,
  num_ids: int | None = None,
  ensemble: bool = False,
  use_cache: bool = True,
  segment: int | None = DECODE_SEGMENT,
  prefix=None,
  count_steps: bool = False,
):
  """The search (traceable; `settings`, `max_decode_len`, `outputs` and the keywords static).

  Args:
    params: the model's (unboxed) parameters, or with `ensemble` several members' stacked on a
      leading axis, decoded by the mean of their probabilities (`ensemble_decoder_state`).
    inputs: [batch, src_len] source ids ending in EOS, 0 on padding.
    rng: the sampling key (step t draws with it folded with t); unused, may be None, when
      `settings` do not sample.
    settings: how to search; each row's output holds at most its source tokens +
      `settings.max_extra_len` tokens, EOS included (with a prefix, at most max(source tokens,
      prefix tokens + 1) + `max_extra_len`: room for the prefix and EOS).
    max_decode_len: the output width.
    outputs: 'ids', 'scores' (ids and the search's scores) or 'token_scores' (and each token's
      log-probability).
    num_ids: only ids below it are emitted (None: every id); use_cache: False re-runs the
      whole model on the prefix every step (the reference); segment: self-attention buffers
      start at this many positions and grow (`decoder_state`).
    prefix: None, or [batch, P] int32 target prefixes: each row's tokens (ids above EOS, below
      `num_ids`), then PAD, P > the longest (a row of PAD: no prefix). Every output of a row
      starts with its prefix; the search goes on from there.
    count_steps: return (the outputs below, [batch] int32 the steps each row searched before it
      was done; the loop ran the largest of them), or (outputs, None) for Marian's search.

  Returns:
    ids [batch, max_decode_len] int32 (tokens up to EOS, then PAD), or with
    `settings.num_hypotheses` n > 1 beam search's n best [batch, n, max_decode_len], best first;
    with 'scores', (ids, scores [batch] or [batch, n] float32: `NBest.scores`); with
    'token_scores', a third array shaped as ids, float32: each token's log-probability (a
    forced EOS 0; 0 after EOS).
  """
  if outputs not in OUTPUTS:
    raise ValueError(f"outputs={outputs!r}: must be one of {OUTPUTS}")
  if ensemble:
    state = ensemble_decoder_state(model, params, inputs, max_decode_len, segment)
  else:
    state = decoder_state(model, params, inputs, max_decode_len, use_cache, segment)
  if settings.length_penalty == MARIAN:  # Marian's own length limit (model/marian_beam.py)
    max_lens = marian_beam.max_lengths(inputs, prefix)
  else:
    max_lens = output_limits(inputs, prefix, settings.max_extra_len)
  loop = dict(
    max_lens=max_lens,
    grow=state.grow,
    segment=state.segment,
    prefix=prefix,
    prefix_rule=settings.prefix_rule,
  )
  step = only_ids_below(state.step, num_ids)
  batch = inputs.shape[0]
  found, steps = _search(
    step, state.cache, rng, settings, batch, max_decode_len, outputs, loop, count_steps
  )
  return (found, steps) if count_steps else found


def _search(
  step, cache, rng, settings: SearchSettings, batch, max_decode_len, outputs, loop, count: bool
):
  """(`generate`'s search of `settings` over the step function and cache, with `count` the steps
  each row searched, else None); `loop`: the keywords every search of model/search.py takes
  alike."""
  want = OUTPUTS.index(outputs) + 1  # how many of ids, scores, token scores
  if settings.length_penalty == MARIAN:  # Marian's search rule: model/marian_beam.py
    marian = {k: v for k, v in loop.items() if k != "prefix_rule"}
    found = marian_beam.beam_search(
      step,
      cache,
      batch,
      max_decode_len,
      beam_size=settings.beam_size,
      alpha=settings.alpha,
      token_scores=want > 2,
      **marian,
    )
    return best_outputs(found, want, settings.num_hypotheses), None
  if settings.sampling or settings.beam_size == 1:
    if settings.sampling:
      found = search.sample(
        step,
        cache,
        rng,
        batch,
        max_decode_len,
        temperature=settings.temperature,
        top_k=settings.top_k,
        scores=want > 1,
        **loop,
      )
    else:
      found = search.greedy_search(step, cache, batch, max_decode_len, scores=want > 1, **loop)
    ids = found if want == 1 else found[0]
    steps = jnp.sum(ids != PAD_ID, axis=-1, dtype=jnp.int32) if count else None  # a token a step
    return (found if want == 1 else found[:want]), steps
  reorder = None
  if ancestry.applies(cache):  # the self-attention buffers kept in place (model/ancestry.py)
    step, cache, reorder = (
      ancestry.in_place_step(step),
      ancestry.with_table(cache),
      ancestry.reorder,
    )
  found = search.beam_search(
    step,
    cache,
    batch,
    max_decode_len,
    beam_size=settings.beam_size,
    alpha=settings.alpha,
    penalty=settings.length_penalty,
    stopping=settings.stopping,
    token_scores=want > 2,
    count_steps=count,
    reorder=reorder,
    **loop,
  )
  found, steps = (found[:-1], found[-1]) if count else (found, None)
  return best_outputs(found, want, settings.num_hypotheses), steps


def best_outputs(found, want: int, n: int):
  """A beam search's first `want` outputs, each cut to its `n` best ([batch, ...] for n = 1)."""
  found = tuple(x[:, 0] if n == 1 else x[:, :n] for x in found[:want])
  return found[0] if want == 1 else found


def nbest(ids, scores, token_scores=None) -> NBest:
  """One sentence's `NBest` from its search results: ids [n, max_decode_len] (or one row
  [max_decode_len]), scores [n] (or []), token scores as ids (or None)."""
  ids = np.asarray(ids).reshape(-1, np.shape(ids)[-1])
  scores = np.asarray(scores, np.float32).reshape(-1)
  tokens = None
  if token_scores is not None:
    token_scores = np.asarray(token_scores).reshape(ids.shape)
    tokens = [t[: int(np.sum(row != PAD_ID))] for row, t in zip(ids, token_scores)]
  return NBest([strip(row) for row in ids], scores, tokens)


def strip(ids) -> np.ndarray:
  """[length] ids -> the tokens before the first EOS, PAD dropped."""
  ids = np.asarray(ids).reshape(-1)
  eos = np.flatnonzero(ids == EOS_ID)
  if len(eos):
    ids = ids[: eos[0]]
  return ids[ids != PAD_ID]
