"""The training loop behind train.py: data -> state (restored or new) -> steps -> eval ->
checkpoints. Importable without flags: `train(config, workdir)`.

The loop never asks which parallelism runs: `training/build.py` gives it the model and a
`training.parallel.Parallel`, whose methods place the state, restore it and hand it to
checkpoints and decoding for either kind.
"""

from __future__ import annotations

import json
import pathlib
import time

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from configs.validate import check_backend, check_config
from core.errors import RunError, UsageError
from core.progress import Progress
from data import pipeline as data_pipeline
from data import tokenizer
from training import checkpoint as ckpt
from training import compatibility, distributed, evaluate
from training import parallel as par
from training.build import build_steps
from training.metrics import MetricsWriter, accumulate, window_means
from training.preemption import Preemption
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
  check_workdir(workdir)
  check_backend(config)
  lock = _lock_workdir(workdir, take_over_lock)
  try:
    check_writable_folder(ckpt.checkpoint_dir(workdir), "checkpoint folder")
    return _train(config, workdir, lock)
  finally:
    if lock is not None:
      lock.release()


def _train(config, workdir: pathlib.Path, lock: WorkdirLock | None) -> dict:
  lead = jax.process_index() == 0
  pipeline = _build_data(config, workdir, par.data_parallel_size(config))
  vocab = pipeline.vocab
  fit_model_vocab(config, vocab.vocab_size)
  logging.info(
    "train batch shapes %s: the step compiles at most %d time(s)",
    pipeline.batch_shapes,
    len(pipeline.batch_shapes),
  )
  model, parallel = build_steps(config)

  # State: resume or start.
  checkpointer = ckpt.Checkpointer(
    workdir,
    keep=config.checkpoint.keep,
    keep_best=config.checkpoint.keep_best,
    async_save=config.checkpoint.async_save,
  )
  train_iter = pipeline.train_iter()
  rng = jax.random.key(config.seed)
  restored = checkpointer.restore_latest(
    parallel.restore_target,
    check_meta=lambda meta: compatibility.check_resumable(
      meta, config, vocab.fingerprint, checkpointer.root
    ),
    explain=lambda meta: compatibility.config_differences(
      compatibility.config_from_meta(meta), config
    ),
  )
  if restored is not None:
    step0, state, meta = restored
    state = parallel.from_restored(state)
    train_iter.restore(meta["data_state"])
    logging.info("resumed from %s at step %d", checkpointer.root / str(step0), step0)
    compatibility.log_changed_recipe(compatibility.config_from_meta(meta), config)
  else:
    state = parallel.init_state(jax.random.fold_in(rng, 1))
    step0 = 0
  if lead and config.data.vocab_path:  # the workdir alone must decode, here or elsewhere
    tokenizer.save_in_workdir(vocab, workdir)
  if step0 >= config.num_train_steps:
    checkpointer.close()
    logging.warning(
      "%s is already at step %d (num_train_steps=%d): nothing to train; raise "
      "num_train_steps to continue",
      checkpointer.root / str(step0),
      step0,
      config.num_train_steps,
    )
    return {}
  rng = jax.random.fold_in(rng, 2)

  writer = MetricsWriter(workdir, enabled=lead)
  progress = Progress(config.num_train_steps, step0, enabled=lead)
  if lead:
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))

  def meta():
    return {
      "config": config.to_json(),
      "data_state": train_iter.state(),
      "seed": config.seed,
      "step": step,
      "vocab": vocab.fingerprint,
    }

  saved_step = step0

  def save(step, metrics=None, force=False):
    nonlocal saved_step
    if checkpointer.save(step, parallel.to_checkpoint(state), meta(), metrics=metrics, force=force):
      saved_step = step

  eval_pairs = pipeline.pairs(config.data.eval_split)
  bleu_pairs = eval_pairs[: config.eval.bleu_sentences] if config.eval.bleu_sentences else []
  eval_batches = pipeline.eval_batches()
  if config.eval.num_batches:
    eval_batches = eval_batches[: config.eval.num_batches]

  def run_eval(step):
    metrics = evaluate.loss_metrics(parallel, state.params, eval_batches)
    if bleu_pairs:
      metrics.update(
        evaluate.translation_metrics(
          model,
          parallel.decoding_params(state),
          vocab,
          bleu_pairs,
          max_len=config.data.max_len,
          max_extra_len=config.eval.max_decode_extra,
        )
      )
    writer.write(step, "eval", metrics)
    return metrics

  step = step0
  last_eval, pending = {}, None
  window = None  # train metrics summed since the last log line (metrics.accumulate)
  t_log, tokens_since = time.time(), 0.0
  t_start = time.time()
  preemption = Preemption(config.stop_timeout_s)
  try:
    while step < config.num_train_steps:
      batch = next(train_iter)
      state, metrics = parallel.train_step(state, batch, rng)
      step += 1
      distributed.at_step(step)  # named in the line of a process that stops when another is lost
      checkpointer.check()  # an asynchronous save that failed stops the run now
      if lock is not None:
        lock.check()
      tokens_since += (
        float((batch["targets_segmentation"] > 0).sum() + (batch["inputs_segmentation"] > 0).sum())
        * jax.process_count()
      )
      # Check the previous step's counter now that this step is queued (no pipeline stall).
      if pending is not None and int(pending) >= config.optim.max_nonfinite_steps:
        raise RunError(
          f"training stopped at step {step - 1}: {int(pending)} consecutive steps had a "
          f"non-finite loss or gradient (optim.max_nonfinite_steps="
          f"{config.optim.max_nonfinite_steps}); lower optim.learning_rate or set "
          f"optim.clip_norm"
        )
      pending = metrics["nonfinite_streak"]
      window = accumulate(window, metrics)
      if step % config.log_every_steps == 0 or step == config.num_train_steps:
        m = window_means(jax.device_get(window), jax.device_get(metrics))
        now = time.time()
        m["tokens_per_s"] = tokens_since / max(now - t_log, 1e-9)
        m["steps_per_s"] = m.pop("steps") / max(now - t_log, 1e-9)
        writer.write(step, "train", m)
        progress.update(step, m["loss"], m["tokens_per_s"])
        t_log, tokens_since, window = now, 0.0, None
      else:
        progress.update(step)
      evaluated = step % config.eval_every_steps == 0 and step != config.num_train_steps
      if evaluated:
        last_eval = run_eval(step)
      if step % config.checkpoint_every_steps == 0 and step != config.num_train_steps:
        # Only this step's own BLEU ranks it for checkpoint.keep_best; an older score would not.
        save(step, {"bleu": last_eval["bleu"]} if evaluated and "bleu" in last_eval else None)
      if preemption.requested(step):
        if saved_step != step:  # the periodic save may just have written this step
          save(step, force=True)
        checkpointer.close()
        progress.close()
        logging.warning(
          "%s received: saved step %d to %s and stopped; re-run the same command to resume",
          preemption.signal or "stop signal",
          step,
          checkpointer.root / str(step),
        )
        return last_eval
    if int(jax.device_get(metrics["nonfinite_streak"])) >= config.optim.max_nonfinite_steps:
      raise RunError(f"training stopped at step {step}: too many consecutive non-finite steps")
    last_eval = run_eval(step)
    save(step, {"bleu": last_eval.get("bleu", 0.0)}, force=True)
  finally:
    preemption.close()
    checkpointer.close()
    progress.close()
    writer.close()
  elapsed = time.time() - t_start
  summary = {"step": step, "train_seconds": round(elapsed, 1), **last_eval}
  if lead:
    print(
      "final: "
      + json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in summary.items()}),
      flush=True,
    )
  return last_eval
