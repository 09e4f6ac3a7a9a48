"""Label-smoothed cross entropy (paper section 5.4) and token accuracy, over padding-weighted
batches. Both return sums and the token count, so callers can sum across devices and
micro-batches before dividing."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _check(logits, targets, weights):
  if logits.ndim != 3 or targets.shape != logits.shape[:2]:
    raise ValueError(
      f"loss: logits must be [batch, length, vocab] and targets [batch, length]; "
      f"got logits {logits.shape}, targets {targets.shape}"
    )
  if weights is not None and weights.shape != targets.shape:
    raise ValueError(
      f"loss: weights shape {weights.shape} must equal targets shape {targets.shape}"
    )


def smoothed_cross_entropy(
  logits: jax.Array,
  targets: jax.Array,
  weights: jax.Array | None = None,
  label_smoothing: float = 0.0,
):
  """Cross entropy against the smoothed distribution q = (1-ε)·onehot(target) + ε/(V-1)·others.

  Computed from the log-sum-exp, the target's logit and the sum of logits, so no
  [batch, length, vocab] one-hot is built. The constant entropy of q is subtracted, so a perfect
  prediction of q scores 0 (as in tensor2tensor).

  Args:
    logits: [batch, length, vocab] (any float dtype; computed in float32).
    targets: [batch, length] ids.
    weights: [batch, length], typically 1.0 on real tokens and 0.0 on padding; None = all 1.
    label_smoothing: ε.

  Returns:
    (summed loss, summed weights), float32 scalars.
  """
  _check(logits, targets, weights)
  vocab = logits.shape[-1]
  logits = logits.astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  nll = lse - target_logit
  if label_smoothing > 0:
    confidence = 1.0 - label_smoothing
    low = label_smoothing / (vocab - 1)
    sum_logp = jnp.sum(logits, axis=-1) - vocab * lse
    sum_other_nll = -(sum_logp + nll)  # Σ_{v≠t} -log p_v
    loss = confidence * nll + low * sum_other_nll
    entropy = -(confidence * jnp.log(confidence) + (vocab - 1) * low * jnp.log(low + 1e-20))
    loss = loss - entropy
  else:
    loss = nll
  if weights is None:
    weights = jnp.ones_like(loss)
  weights = weights.astype(jnp.float32)
  return jnp.sum(loss * weights), jnp.sum(weights)


def token_accuracy(logits: jax.Array, targets: jax.Array, weights: jax.Array | None = None):
  """(number of weighted positions whose target has the largest logit, summed weights).

  For float32 logits, "the target's logit equals the row maximum": the argmax test up to exact
  ties (which then count as correct), reusing the maximum the log-sum-exp of the loss already
  takes instead of a separate arg-max pass over [batch, length, vocab]. bfloat16/float16 logits
  round near-equal values to ties, which would count a runner-up target as correct, so they take
  the arg-max (the token greedy decoding picks).
  """
  _check(logits, targets, weights)
  if logits.dtype == jnp.float32:
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    correct = (target_logit >= jnp.max(logits, axis=-1)).astype(jnp.float32)
  else:
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
  if weights is None:
    weights = jnp.ones_like(correct)
  weights = weights.astype(jnp.float32)
  return jnp.sum(correct * weights), jnp.sum(weights)
