"""A run's config -> the model and its train/eval steps, wrapped for the devices.

    model, parallel = build_steps(config)
    state = parallel.init_state(rng)
    state, metrics = parallel.train_step(state, batch, rng)

train.py, bench.py and the tests all build the step here, so they time and test the same one.
"""

from __future__ import annotations

import functools

from absl import logging

from model.build import build_model
from training import parallel as par
from training import step as step_lib
from training.state import init_state, make_optimizer
from training.validate import uses_cudnn


def build_steps(config):
  """The model and the train/eval steps wrapped for `config.parallelism`: (model, Parallel).
  train.py, bench.py and the tests all build the step here, so they time and test the same one.
  The config is checked first by `training.validate.check_config`."""
  model = build_model(config.model)
  if uses_cudnn(config) and config.model.get("attention_dropout_rate"):
    logging.warning(
      "model.attention_impl='cudnn' with model.attention_dropout_rate=%g: training "
      "steps take the XLA attention path (cuDNN's kernel has no dropout here); eval "
      "and decoding use cuDNN",
      config.model.attention_dropout_rate,
    )
  tx, schedule = make_optimizer(config)
  train_step = functools.partial(
    step_lib.train_step,
    model=model,
    tx=tx,
    schedule=schedule,
    label_smoothing=config.optim.label_smoothing,
    grad_accum_steps=int(config.optim.grad_accum_steps),
  )
  eval_step = functools.partial(
    step_lib.eval_step, model=model, label_smoothing=config.optim.label_smoothing
  )
  parallel = par.build(
    config.parallelism,
    config,
    init_fn=lambda rng: init_state(model, tx, rng),
    train_step=train_step,
    eval_step=eval_step,
  )
  return model, parallel
