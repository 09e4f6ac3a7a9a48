"""The training state (parameters, Optax state, step) and the paper's optimizer (section 5.3)."""

from __future__ import annotations

from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from model.build import init_variables


@flax.struct.dataclass
class TrainState:
  """Everything the step updates. `nonfinite_streak` counts consecutive skipped updates."""

  step: jax.Array
  params: Any
  opt_state: Any
  nonfinite_streak: jax.Array


def learning_rate_schedule(optim_cfg, d_model: int, total_steps: int = 100_000):
  """step (0-based optimizer count) -> learning rate.

  'rsqrt' (the paper's): lrate = learning_rate · d_model^-0.5 · min(s^-0.5, s · warmup^-1.5),
  s = step + 1.
  'constant': learning_rate after a linear warmup. 'cosine': linear warmup to learning_rate, then
  cosine decay to 0 at `total_steps`.
  """
  kind = optim_cfg.schedule
  warmup = max(int(optim_cfg.warmup_steps), 1)
  peak = float(optim_cfg.learning_rate)
  if kind == "rsqrt":

    def schedule(count):
      s = jnp.asarray(count, jnp.float32) + 1.0
      return peak * d_model**-0.5 * jnp.minimum(s**-0.5, s * warmup**-1.5)

    return schedule
  if kind == "constant":
    return lambda count: peak * jnp.minimum(1.0, (jnp.asarray(count, jnp.float32) + 1.0) / warmup)
  if kind == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(total_steps, warmup + 1))
  raise ValueError(f"config error: optim.schedule={kind!r}; valid: rsqrt, constant, cosine")


def make_optimizer(config) -> tuple[optax.GradientTransformation, Any]:
  """Adam(β1, β2, ε) on the schedule, optional global-norm clipping and decoupled weight decay.

  The state is a dict with the same keys whatever is switched on ('clip' and 'weight_decay' are
  stateless identities when off), so a run can resume with clipping or weight decay changed.
  """
  o = config.optim
  schedule = learning_rate_schedule(o, config.model.d_model, config.num_train_steps)
  clip = (
    optax.clip_by_global_norm(o.clip_norm) if o.clip_norm and o.clip_norm > 0 else optax.identity()
  )
  decay = optax.add_decayed_weights(o.weight_decay) if o.weight_decay else optax.identity()
  return optax.named_chain(
    ("clip", clip),
    ("adam", optax.scale_by_adam(b1=o.b1, b2=o.b2, eps=o.eps)),
    ("weight_decay", decay),
    ("learning_rate", optax.scale_by_learning_rate(schedule)),
  ), schedule


def init_state(model: nn.Module, tx: optax.GradientTransformation, rng: jax.Array) -> TrainState:
  """A fresh state. Parameters keep their logical-axis boxes (`nn.Partitioned`) so callers can read
  the sharding spec with `nn.get_partition_spec`; `nn.unbox` the result before training."""
  params = init_variables(model, rng)["params"]
  return TrainState(
    step=jnp.zeros((), jnp.int32),
    params=params,
    opt_state=tx.init(params),
    nonfinite_streak=jnp.zeros((), jnp.int32),
  )
