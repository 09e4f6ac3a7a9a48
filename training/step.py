"""The training and evaluation steps: pure functions of one device's view of the batch.

    train_step(state, batch, rng, *, model, tx, schedule, label_smoothing, grad_accum_steps=1,
               axis_name=None) -> (state, metrics)
    eval_step(params, batch, *, model, label_smoothing, axis_name=None) -> sums

With `axis_name` (the pmap case) gradients and metric sums are summed over that axis with
`lax.psum`; without it the step sees the whole (possibly Mesh-sharded) batch and XLA inserts the
collectives. Nothing here knows which: `training/parallel.py` wraps it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from model.loss import smoothed_cross_entropy, token_accuracy
from training.state import TrainState

BATCH_KEYS = (
  "inputs",
  "targets",
  "inputs_position",
  "targets_position",
  "inputs_segmentation",
  "targets_segmentation",
)


def _weights(batch):
  """1.0 on real target tokens (segment id > 0), 0.0 on padding."""
  return (batch["targets_segmentation"] > 0).astype(jnp.float32)


def _sums(model, params, batch, rng, label_smoothing, deterministic, scale=1.0):
  """(scale × summed loss, the differentiated value; {summed loss, nll, correct predictions,
  token count}) of one (micro-)batch."""
  logits = model.apply(
    {"params": params},
    batch["inputs"],
    batch["targets"],
    batch["inputs_position"],
    batch["targets_position"],
    batch["inputs_segmentation"],
    batch["targets_segmentation"],
    deterministic=deterministic,
    rngs=None if deterministic else {"dropout": rng},
  )
  weights = _weights(batch)
  loss, tokens = smoothed_cross_entropy(logits, batch["targets"], weights, label_smoothing)
  correct, _ = token_accuracy(logits, batch["targets"], weights)
  nll = loss
  if label_smoothing > 0:  # report the plain negative log-likelihood too (perplexity)
    nll, _ = smoothed_cross_entropy(logits, batch["targets"], weights, 0.0)
  return loss * scale, {"loss": loss, "nll": nll, "correct": correct, "tokens": tokens}


def _psum(tree, axis_name):
  return tree if axis_name is None else jax.lax.psum(tree, axis_name)


def _accumulated(grad_fn, params, batch, rng, grad_accum_steps: int):
  """The gradients and sums of `batch` split into `grad_accum_steps` micro-batches, added."""
  rows = batch["targets"].shape[0]
  if rows % grad_accum_steps:
    raise ValueError(
      f"train_step: batch of {rows} rows is not divisible by "
      f"optim.grad_accum_steps={grad_accum_steps}"
    )
  # Micro-batch i takes rows i, i+k, i+2k, ...: every device's block of the (data-sharded)
  # batch holds rows of every micro-batch, so each micro-batch runs on all devices; consecutive
  # blocks would put micro-batch i on a k-th of them.
  micro = jax.tree_util.tree_map(
    lambda x: x.reshape(rows // grad_accum_steps, grad_accum_steps, *x.shape[1:]).swapaxes(0, 1),
    batch,
  )

  def accumulate(carry, xs):
    i, mb = xs
    g, s = grad_fn(params, mb, jax.random.fold_in(rng, i))
    return jax.tree_util.tree_map(jnp.add, carry, (g, s)), None

  zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
  zero_sums = {k: jnp.zeros((), jnp.float32) for k in ("loss", "nll", "correct", "tokens")}
  (grads, sums), _ = jax.lax.scan(
    accumulate, (zeros, zero_sums), (jnp.arange(grad_accum_steps), micro)
  )
  return grads, sums


def train_step(
  state: TrainState,
  batch,
  rng,
  *,
  model,
  tx: optax.GradientTransformation,
  schedule,
  label_smoothing: float,
  grad_accum_steps: int = 1,
  axis_name: str | None = None,
):
  """One optimizer update on `batch` (dict of [batch, length] int32 arrays, see BATCH_KEYS).

  The loss is the label-smoothed cross entropy summed over all target tokens of the global batch
  divided by their number, so with `grad_accum_steps=k` the batch is split into k micro-batches
  whose loss sums, each divided by that same global count, have their gradients added: the
  update equals one step on the whole batch. A non-finite loss or gradient leaves the state
  unchanged (counted in metrics).
  """
  rng = jax.random.fold_in(rng, state.step)
  if axis_name is not None:
    rng = jax.random.fold_in(rng, jax.lax.axis_index(axis_name))
  # The token count of the global batch is known before the forward pass, so the gradient is
  # taken of the mean loss directly (the 1/tokens scales the backward pass's first cotangent)
  # rather than divided out of every gradient afterwards.
  denom = jnp.maximum(_psum(jnp.sum(_weights(batch)), axis_name), 1.0)
  grad_fn = jax.grad(
    lambda p, b, r: _sums(model, p, b, r, label_smoothing, False, 1.0 / denom), has_aux=True
  )

  if grad_accum_steps == 1:
    grads, sums = grad_fn(state.params, batch, rng)
  else:
    grads, sums = _accumulated(grad_fn, state.params, batch, rng, grad_accum_steps)
  grads, sums = _psum((grads, sums), axis_name)
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(grad_norm) & jnp.isfinite(sums["loss"])

  def update(_):
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    return optax.apply_updates(state.params, updates), opt_state

  # A branch, not a select over every parameter and Adam moment (a pass over all of them).
  params, opt_state = jax.lax.cond(finite, update, lambda _: (state.params, state.opt_state), None)
  new_state = state.replace(
    step=state.step + 1,
    params=params,
    opt_state=opt_state,
    nonfinite_streak=jnp.where(finite, 0, state.nonfinite_streak + 1),
  )
  metrics = {
    "loss": sums["loss"] / denom,
    "nll": sums["nll"] / denom,
    "accuracy": sums["correct"] / denom,
    "tokens": sums["tokens"],
    "grad_norm": grad_norm,
    # The optimizer's own count: it does not advance on a skipped (non-finite) step.
    "learning_rate": schedule(state.opt_state["learning_rate"].count),
    "nonfinite": 1 - finite.astype(jnp.int32),
    "nonfinite_streak": new_state.nonfinite_streak,
  }
  return new_state, metrics


def eval_step(params, batch, *, model, label_smoothing: float, axis_name: str | None = None):
  """Summed loss, nll, correct predictions and tokens of one eval batch (divide after summing
  over all batches)."""
  _, sums = _sums(model, params, batch, None, label_smoothing, True)
  return _psum(sums, axis_name)
