"""The training loop behind train.py: data -> state (restored, new, or fine-tuned from
config.init_from: training/finetune.py) -> steps, each followed by the periodic actions of
training/periodic.py (heartbeat, non-finite stop, log, eval, early stopping, checkpoint) and a
stop signal's check -> a last eval and checkpoint. Importable without flags:
`train(config, workdir)`.

The loop never asks which parallelism runs: `training/run_steps.py` gives it the model and a
`training.parallel.Parallel`, whose methods place the state, restore it and hand it to
checkpoints and decoding for either kind.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import time

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from core.errors import UsageError
from core.progress import Progress
from data import pipeline as data_pipeline
from data import tokenizer
from training import checkpoint as ckpt
from training import compatibility, finetune, periodic
from training import parallel as par
from training.metric_log import MetricsWriter
from training.preemption import Preemption
from training.run_steps import build_steps
from training.validate import check_backend, check_config
from training.workdir import WorkdirLock, check_workdir, check_writable_folder


def fit_model_vocab(config, vocab_size: int) -> None:
  """Sets model.vocab_size 0 to the vocabulary's `vocab_size`; a smaller one is a config error, a
  larger one a warning (the extra ids never occur, yet get logits and label-smoothing mass)."""
  with config.unlocked():
    if config.model.vocab_size <= 0:
      config.model.vocab_size = vocab_size
  if vocab_size > config.model.vocab_size:
    raise UsageError(
      f"config error: model.vocab_size={config.model.vocab_size} is smaller than the "
      f"vocabulary ({vocab_size} ids)"
    )
  if vocab_size < config.model.vocab_size:
    logging.warning(
      "model.vocab_size=%d is larger than the vocabulary (%d ids): ids %d and up "
      "never occur but still get logits and label-smoothing mass; set "
      "model.vocab_size=0 to use the vocabulary's size",
      config.model.vocab_size,
      vocab_size,
      vocab_size,
    )


def _build_data(config, workdir: pathlib.Path, data_parallel: int):
  """The data pipeline. Process 0 trains the vocabulary and tokenizes first, so the others reuse
  its vocabulary and cache."""

  def build():
    return data_pipeline.build(
      config,
      workdir,
      batch_multiple=data_parallel * int(config.optim.grad_accum_steps),
      process_index=jax.process_index(),
      process_count=jax.process_count(),
    )

  if jax.process_count() == 1:
    return build()
  pipeline = build() if jax.process_index() == 0 else None
  multihost_utils.sync_global_devices("data ready")
  return pipeline or build()


def _lock_workdir(workdir: pathlib.Path, take_over: bool) -> WorkdirLock | None:
  """Process 0 takes `<workdir>/lock` (training/workdir.py); the others learn whether it could,
  so that a refused job stops on every process instead of hanging in its first collective."""
  lock, refused = None, None
  if jax.process_index() == 0:
    try:
      lock = WorkdirLock(workdir, take_over=take_over).acquire()
    except UsageError as e:
      refused = e
  if jax.process_count() > 1:
    if multihost_utils.broadcast_one_to_all(np.int32(refused is not None)) and refused is None:
      raise UsageError(f"process 0 could not lock {workdir} (see its error)")
  if refused is not None:
    raise refused
  return lock


def train(config, workdir: pathlib.Path, take_over_lock: bool = False) -> dict:
  """The whole run; returns the last eval metrics. Process 0 holds the workdir's lock from
  before anything is written until the end; `take_over_lock` takes it from a live holder."""
  check_config(config, "train")
  workdir = pathlib.Path(workdir)
  source = finetune.resolve(config, workdir)  # init_from: read and checked before any write
  if config.get("init_from") and source is None:
    logging.info("init_from=%s not read: %s resumes its own checkpoints", config.init_from, workdir)
  check_workdir(workdir)
  check_backend(config)
  lock = _lock_workdir(workdir, take_over_lock)
  try:
    check_writable_folder(ckpt.checkpoint_dir(workdir), "checkpoint folder")
    return _train(config, workdir, lock, source)
  finally:
    if lock is not None:
      lock.release()


def _train(config, workdir: pathlib.Path, lock: WorkdirLock | None, source) -> dict:
  lead = jax.process_index() == 0
  pipeline = _data_and_vocab(config, workdir, source, lead)
  vocab = pipeline.vocab
  model, parallel = build_steps(config)
  checkpointer = ckpt.Checkpointer(
    workdir,
    keep=config.checkpoint.keep,
    keep_best=config.checkpoint.keep_best,
    async_save=config.checkpoint.async_save,
  )
  train_iter = pipeline.train_iter()
  step, state, resumed = _resume_or_start(
    config, checkpointer, parallel, train_iter, vocab.fingerprint, source
  )
  stopping = periodic.EarlyStopping(config.early_stopping, resumed.get("early_stopping"))
  if lead and config.data.vocab_path:  # the workdir alone must decode, here or elsewhere
    tokenizer.save_in_workdir(vocab, workdir)
  if step >= config.num_train_steps or stopping.stop:
    _nothing_to_train(checkpointer, stopping, step, config.num_train_steps)
    return {}
  writer = MetricsWriter(workdir, enabled=lead)
  progress = Progress(config.num_train_steps, step, enabled=lead)
  if lead:
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))
  meta = functools.partial(_checkpoint_meta, config, train_iter, vocab.fingerprint, stopping)
  actions = _Actions.make(
    config, pipeline, model, parallel, writer, progress, checkpointer, lock, meta, stopping, step
  )
  t_start = time.time()
  preemption = Preemption(config.stop_timeout_s)
  try:
    step, final, finished = _steps(config, state, step, train_iter, parallel, actions, preemption)
  finally:
    preemption.close()
    checkpointer.close()
    progress.close()
    writer.close()
  if not finished:  # stopped by a signal
    return final
  if lead and stopping.stop:
    logging.warning("%s", stopping.line(step))
  if lead:
    summary = {"step": step, "train_seconds": round(time.time() - t_start, 1), **final}
    rounded = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in summary.items()}
    print("final: " + json.dumps(rounded), flush=True)
  return final


def _data_and_vocab(config, workdir: pathlib.Path, source, lead: bool):
  """The data pipeline, its vocabulary checked against a fine-tuning `source` and
  model.vocab_size fitted to it."""
  if lead and source is not None:
    finetune.place_vocab(source, workdir)
  pipeline = _build_data(config, workdir, par.data_parallel_size(config))
  if source is not None:
    finetune.check_vocab(source, pipeline.vocab)
  fit_model_vocab(config, pipeline.vocab.vocab_size)
  logging.info(
    "train batch shapes %s: the step compiles at most %d time(s)",
    pipeline.batch_shapes,
    len(pipeline.batch_shapes),
  )
  return pipeline


def _nothing_to_train(checkpointer, stopping, step: int, last_step: int) -> None:
  """Closes the checkpoints and says why a resumed run has no step to take."""
  checkpointer.close()
  if stopping.stop:
    logging.warning("%s; raise early_stopping.patience to continue", stopping.line(step))
  else:
    logging.warning(
      "%s is already at step %d (num_train_steps=%d): nothing to train; raise "
      "num_train_steps to continue",
      checkpointer.root / str(step),
      step,
      last_step,
    )


@dataclasses.dataclass
class _Actions:
  """What runs after each step, in this order (training/periodic.py); each acts on its own
  schedule."""

  heartbeat: periodic.Heartbeat
  nonfinite: periodic.NonfiniteStop
  log: periodic.LogWindow
  evaluation: periodic.Evaluation
  stopping: periodic.EarlyStopping
  checkpoints: periodic.Checkpoints
  progress: Progress

  @classmethod
  def make(
    cls,
    config,
    pipeline,
    model,
    parallel,
    writer,
    progress,
    checkpointer,
    lock,
    meta,
    stopping,
    step: int,
  ) -> _Actions:
    """The actions of a run resumed (or started) at `step`; `meta` gives a checkpoint's
    metadata."""
    last_step = config.num_train_steps
    heartbeat = periodic.Heartbeat(checkpointer, lock)
    nonfinite = periodic.NonfiniteStop(config.optim.max_nonfinite_steps)
    log_due = periodic.Every(config.log_every_steps, last_step, with_last=True)
    log = periodic.LogWindow(writer, progress, log_due)
    eval_due = periodic.Every(config.eval_every_steps, last_step)
    evaluation = periodic.Evaluation(config, pipeline, model, parallel, writer, eval_due)
    stopping.evaluation = evaluation
    save_due = periodic.Every(config.checkpoint_every_steps, last_step)
    checkpoints = periodic.Checkpoints(checkpointer, parallel, meta, evaluation, save_due, step)
    return cls(heartbeat, nonfinite, log, evaluation, stopping, checkpoints, progress)

  def __call__(self, done: periodic.StepDone) -> None:
    for action in (
      self.heartbeat,
      self.nonfinite,
      self.log,
      self.evaluation,
      self.stopping,
      self.checkpoints,
    ):
      action(done)


def _steps(config, state, step: int, train_iter, parallel, actions: _Actions, preemption):
  """The steps up to num_train_steps (or early stopping's end), each followed by `actions`, then
  the last evaluation and checkpoint: (step, the last eval metrics, False when a stop signal
  ended the run first)."""
  rng = jax.random.fold_in(jax.random.key(config.seed), 2)
  evaluation, stopping, checkpoints = actions.evaluation, actions.stopping, actions.checkpoints
  while step < config.num_train_steps:
    batch = next(train_iter)
    state, metrics = parallel.train_step(state, batch, rng)
    step += 1
    done = periodic.StepDone(step, state, batch, metrics)
    actions(done)
    if stopping.stop:
      break
    if preemption.requested(step):
      periodic.stop_on_signal(preemption, checkpoints, done, actions.progress)
      return step, evaluation.last, False
  actions.nonfinite.at_end(done)
  if stopping.stop:  # evaluated at this step: its checkpoint, unless the periodic one is it
    final = evaluation.last
    if checkpoints.saved_step != step:
      checkpoints.save(done, {"bleu": final.get("bleu", 0.0)}, force=True)
  else:
    final = evaluation.run(done)
    stopping.observe(step, final)
    checkpoints.save(done, {"bleu": final.get("bleu", 0.0)}, force=True)
  return step, final, True


def _resume_or_start(config, checkpointer, parallel, train_iter, vocab_fingerprint: str, source):
  """(step, state, meta): the newest checkpoint's that this config may resume, `train_iter` put
  back where that run was; or 0, a new state (with the parameters of `source`, a
  training.finetune.Source, when given) and {}."""
  restored = checkpointer.restore_latest(
    parallel.restore_target,
    check_meta=lambda meta: compatibility.check_resumable(
      meta, config, vocab_fingerprint, checkpointer.root
    ),
    explain=lambda meta: compatibility.config_differences(
      compatibility.config_from_meta(meta), config
    ),
  )
  if restored is None:
    rng = jax.random.fold_in(jax.random.key(config.seed), 1)
    if source is not None:
      return 0, finetune.initial_state(source, parallel, rng, config), {}
    return 0, parallel.init_state(rng), {}
  step, state, meta = restored
  state = parallel.from_restored(state)
  train_iter.restore(meta["data_state"])
  logging.info("resumed from %s at step %d", checkpointer.root / str(step), step)
  compatibility.log_changed_recipe(compatibility.config_from_meta(meta), config)
  return step, state, meta


def _checkpoint_meta(config, train_iter, vocab_fingerprint: str, stopping, step: int) -> dict:
  """What a checkpoint holds beside the state: the config, the data position, the vocabulary's
  fingerprint (training/compatibility.py checks them on resume), early stopping's count."""
  return {
    "config": config.to_json(),
    "data_state": train_iter.state(),
    "early_stopping": stopping.state(),
    "seed": config.seed,
    "step": step,
    "vocab": vocab_fingerprint,
  }
