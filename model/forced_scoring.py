"""Scores of given translations (forced decoding): the log-probability a model gives each target
token of a sentence pair, teacher-forced in one deterministic forward pass, as CTranslate2's
`score_batch` and fairseq's `--score-reference` give them.

    token_logp, total = score(model, params, inputs, targets)   # [batch, tgt_len], [batch]
    token_logp, total = score(model, stacked, inputs, targets, ensemble=True)

Which distribution: by default the model's full softmax, the one the training loss reads, so
`-total.sum()` is the unsmoothed cross entropy `model/loss.py` sums on the same pairs (the eval
step's `nll`, training/step.py). With `as_search=True`, PAD (and ids >= `num_ids`) are made
impossible and the rest renormalised, as the searches draw their tokens
(model/distribution.py): then a hypothesis' total is
the summed log-probability beam search scores it by (its score at alpha=0). The two differ by the
probability the model leaves on PAD, which training drives towards 0 (PAD is never a weighted
target) but never reaches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from model import distribution
from model.special_tokens import PAD_ID


def _logits(model, params, inputs, targets):
  """[batch, tgt_len, vocab] float32 teacher-forced logits (no dropout)."""
  return model.apply({"params": params}, inputs, targets, deterministic=True).astype(jnp.float32)


def _target_log_probs(logits, targets):
  """log softmax(logits)[target] [batch, tgt_len], computed as model/loss.py computes its
  negative (the target's logit minus the log-sum-exp), so the two agree to the last bits."""
  lse = jax.nn.logsumexp(logits, axis=-1)
  return jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0] - lse


def score(
  model,
  params,
  inputs,
  targets,
  *,
  ensemble: bool = False,
  as_search: bool = False,
  num_ids: int | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Teacher-forced log-probabilities of `targets` given `inputs`.

  Args:
    model: a module from `model.build.build_model` (any type); params: its unboxed parameters,
      or with `ensemble` the members' parameters stacked on a leading axis (same architecture),
      mixed as `model.decoder_state.ensemble_decoder_state` mixes them: the log of the members'
      mean probability, log(1/M * sum_m p_m(y | prefix)).
    inputs: [batch, src_len] source ids ending in EOS, 0 on padding.
    targets: [batch, tgt_len] target ids (as training batches: ending in EOS, 0 on padding);
      position t is scored given the source and targets[:, :t].
    as_search: the searches' distribution instead of the training loss's (module doc); with
      `num_ids`, ids >= num_ids are impossible too (the vocabulary's size, when the model has
      more output rows than pieces).

  Returns:
    (token log-probabilities [batch, tgt_len] float32, 0 on padding; their sum per row [batch]).
  """
  inputs, targets = jnp.asarray(inputs, jnp.int32), jnp.asarray(targets, jnp.int32)
  if inputs.ndim != 2 or targets.ndim != 2 or inputs.shape[0] != targets.shape[0]:
    raise ValueError(
      f"score: inputs and targets must be [batch, length] with the same batch; got inputs "
      f"{inputs.shape}, targets {targets.shape}"
    )
  if num_ids is not None and not as_search:
    raise ValueError("score: num_ids applies to the searches' distribution (as_search=True)")
  if ensemble:

    def member(p):
      logits = _logits(model, p, inputs, targets)
      return distribution.log_probs(distribution.mask(logits) if as_search else logits), None

    logits, _ = distribution.mixed(member, params, who="score")
    if as_search:  # as the search: masked after mixing, renormalised
      logits = distribution.mask_ids(logits, num_ids)
  else:
    logits = _logits(model, params, inputs, targets)
    if as_search:
      logits = distribution.mask(logits, num_ids)
  token_logp = jnp.where(targets != PAD_ID, _target_log_probs(logits, targets), 0.0)
  return token_logp, jnp.sum(token_logp, axis=1)
