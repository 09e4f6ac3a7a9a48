"""What the training loop does after each step, as flax's clu periodic actions: every action is
called with each finished step (`StepDone`) and decides on its own schedule whether to act.

    heartbeat, nonfinite, log, evaluation, stopping, checkpoints   # built once (training/loop.py)
    for each step:
      done = StepDone(step, state, batch, metrics)
      heartbeat(done); nonfinite(done); log(done); evaluation(done); stopping(done)
      checkpoints(done)
      if stopping.stop: break                                   # early stopping

The run's last step belongs to the loop, which evaluates and saves it once the steps end: the
evaluation and checkpoint schedules skip it, the log's keeps it (its last record). Stopping on a
signal has the same shape, `Preemption.requested(step)` (training/preemption.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from cluster import distributed
from core.errors import RunError
from training import evaluate
from training.metric_log import accumulate, window_means


@dataclasses.dataclass(frozen=True)
class StepDone:
  """A finished train step, as the actions see it."""

  step: int  # steps done so far (1 after the first)
  state: Any  # the train state after it (training/state.py), placed by training.parallel
  batch: dict  # its batch: numpy arrays [rows, length] (inputs, targets, their segmentation...)
  metrics: dict  # its metrics (training/step.py), still on the device


@dataclasses.dataclass(frozen=True)
class Every:
  """A schedule: steps that are multiples of `steps`; the run's `last_step` only `with_last`."""

  steps: int
  last_step: int
  with_last: bool = False

  def __call__(self, step: int) -> bool:
    if step == self.last_step:
      return self.with_last
    return step % self.steps == 0


class Heartbeat:
  """Every step: records the step this process reached (named in the line of a process that
  stops when another is lost, cluster/distributed.py), and stops the run (RunError) when an
  asynchronous save failed or another run took the workdir's lock (`lock`: None on processes
  other than 0)."""

  def __init__(self, checkpointer, lock):
    self.checkpointer, self.lock = checkpointer, lock

  def __call__(self, done: StepDone) -> None:
    distributed.at_step(done.step)
    self.checkpointer.check()
    if self.lock is not None:
      self.lock.check()


class NonfiniteStop:
  """Every step: stops the run (RunError) once `limit` consecutive steps had a non-finite loss or
  gradient (optim.max_nonfinite_steps). A step's streak is read after the next step is queued, so
  that reading it never stalls the device; `at_end` reads the last one."""

  def __init__(self, limit: int):
    self.limit = limit
    self._pending = None  # the previous step's streak, on the device

  def __call__(self, done: StepDone) -> None:
    if self._pending is not None and int(self._pending) >= self.limit:
      raise RunError(
        f"training stopped at step {done.step - 1}: {int(self._pending)} consecutive steps had a "
        f"non-finite loss or gradient (optim.max_nonfinite_steps={self.limit}); lower "
        f"optim.learning_rate or set optim.clip_norm"
      )
    self._pending = done.metrics["nonfinite_streak"]

  def at_end(self, done: StepDone) -> None:
    if int(jax.device_get(done.metrics["nonfinite_streak"])) >= self.limit:
      raise RunError(f"training stopped at step {done.step}: too many consecutive non-finite steps")


class LogWindow:
  """On `due` steps: the train record of the steps since the previous one (their metrics summed
  on the device, training/metric_log.py; tokens and steps per second) to `writer` and `progress`;
  on other steps the progress bar alone."""

  def __init__(self, writer, progress, due: Every):
    self.writer, self.progress, self.due = writer, progress, due
    self._window = None  # train metrics summed since the last record (metrics.accumulate)
    self._tokens, self._since = 0.0, time.time()

  def __call__(self, done: StepDone) -> None:
    batch = done.batch
    tokens = (batch["targets_segmentation"] > 0).sum() + (batch["inputs_segmentation"] > 0).sum()
    self._tokens += float(tokens) * jax.process_count()
    self._window = accumulate(self._window, done.metrics)
    if not self.due(done.step):
      self.progress.update(done.step)
      return
    record = window_means(jax.device_get(self._window), jax.device_get(done.metrics))
    now = time.time()
    record["tokens_per_s"] = self._tokens / max(now - self._since, 1e-9)
    record["steps_per_s"] = record.pop("steps") / max(now - self._since, 1e-9)
    self.writer.write(done.step, "train", record)
    self.progress.update(done.step, record["loss"], record["tokens_per_s"])
    self._since, self._tokens, self._window = now, 0.0, None


class Evaluation:
  """On `due` steps (and when the loop calls `run`): loss metrics over the eval split's batches
  (the first eval.num_batches, 0: all) and, for eval.bleu_sentences > 0, BLEU of greedy
  translations of that many of its sentences, written as an eval record. `last` holds the newest
  metrics ({} before the first), `step` their step."""

  def __init__(self, config, pipeline, model, parallel, writer, due: Every):
    self.config, self.model, self.parallel = config, model, parallel
    self.writer, self.due = writer, due
    self.vocab = pipeline.vocab
    pairs = pipeline.pairs(config.data.eval_split)
    self.bleu_pairs = pairs[: config.eval.bleu_sentences] if config.eval.bleu_sentences else []
    self.batches = pipeline.eval_batches()
    if config.eval.num_batches:
      self.batches = self.batches[: config.eval.num_batches]
    self.step, self.last, self._search = None, {}, None

  def __call__(self, done: StepDone) -> None:
    if self.due(done.step):
      self.run(done)

  @property
  def search(self):
    """The BLEU sentences' compiled search, made at the first evaluation and kept for the run."""
    if self._search is None:
      self._search = evaluate.translation_search(
        self.model, self.vocab, max_extra_len=self.config.eval.max_decode_extra
      )
    return self._search

  def run(self, done: StepDone) -> dict:
    state = done.state
    metrics = evaluate.loss_metrics(self.parallel, state.params, self.batches)
    if self.bleu_pairs:
      metrics.update(
        evaluate.translation_metrics(
          self.model,
          self.parallel.decoding_params(state),
          self.vocab,
          self.bleu_pairs,
          max_len=self.config.data.max_len,
          max_extra_len=self.config.eval.max_decode_extra,
          search=self.search,
        )
      )
    self.writer.write(done.step, "eval", metrics)
    self.step, self.last = done.step, metrics
    return metrics


class EarlyStopping:
  """After each evaluation (of `evaluation`, at the step it ran): counts the evaluations in a row
  whose val `config.metric` ('bleu': higher is better; 'loss': lower) did not beat the best so far
  by at least `config.min_delta` (and by more than 0); `stop` once `config.patience` of them did
  (0: never). `saved`: the `state()` a checkpoint's meta holds, so that a resumed run goes on
  counting (a state of another metric is not taken). Off (nothing counted) with patience 0."""

  def __init__(self, config, saved: dict | None = None, evaluation=None):
    self.metric, self.patience = config.metric, int(config.patience)
    self.min_delta, self.evaluation = float(config.min_delta), evaluation
    self.best, self.best_step, self.waited, self._seen = None, None, 0, None
    if saved and saved.get("metric") == self.metric:
      self.best, self.best_step, self.waited = saved["best"], saved["best_step"], saved["waited"]

  def __call__(self, done: StepDone) -> None:
    if self.evaluation is not None and self.evaluation.step == done.step:
      self.observe(done.step, self.evaluation.last)

  def observe(self, step: int, metrics: dict) -> None:
    """Counts the evaluation `metrics` of `step` (once per step)."""
    if not self.patience or self.metric not in metrics or step == self._seen:
      return
    self._seen, value = step, float(metrics[self.metric])
    if jax.process_count() > 1:  # each decodes its own BLEU: all take process 0's, stop together
      value = float(multihost_utils.broadcast_one_to_all(np.float32(value)))
    if self.best is None:
      gain = None
    else:
      gain = value - self.best if self.metric == "bleu" else self.best - value
    if gain is None or (gain > 0 and gain >= self.min_delta):
      self.best, self.best_step, self.waited = value, step, 0
    else:
      self.waited += 1

  @property
  def stop(self) -> bool:
    return self.patience > 0 and self.waited >= self.patience

  def state(self) -> dict:
    return {
      "metric": self.metric,
      "best": self.best,
      "best_step": self.best_step,
      "waited": self.waited,
    }

  def line(self, step: int) -> str:
    """The run's last line once `stop`: the metric, its best value and step."""
    return (
      f"early stopping at step {step}: val {self.metric} has not beaten its best"
      + (f" by {self.min_delta:g} or more" if self.min_delta else "")
      + f" in {self.waited} evaluations "
      f"(early_stopping.patience={self.patience}); best {self.metric} {self.best:.4f} at step "
      f"{self.best_step}"
    )


class Checkpoints:
  """On `due` steps (and when the loop calls `save`): the state and `meta(step)` to
  `checkpointer` (training/checkpoint.py). A periodic save is ranked for checkpoint.keep_best by
  the BLEU of `evaluation` at the same step only: an older score would not rank it.
  `saved_step`: the newest step written (at first the step the run started from)."""

  def __init__(
    self, checkpointer, parallel, meta: Callable[[int], dict], evaluation, due: Every, saved_step
  ):
    self.checkpointer, self.parallel, self.meta = checkpointer, parallel, meta
    self.evaluation, self.due, self.saved_step = evaluation, due, saved_step

  def __call__(self, done: StepDone) -> None:
    if not self.due(done.step):
      return
    evaluation = self.evaluation
    ranked = evaluation.step == done.step and "bleu" in evaluation.last
    self.save(done, {"bleu": evaluation.last["bleu"]} if ranked else None)

  def save(self, done: StepDone, metrics: dict | None = None, force: bool = False) -> None:
    state = self.parallel.to_checkpoint(done.state)
    if self.checkpointer.save(done.step, state, self.meta(done.step), metrics=metrics, force=force):
      self.saved_step = done.step


def stop_on_signal(preemption, checkpoints: Checkpoints, done: StepDone, progress) -> None:
  """After `preemption` (training/preemption.py) stopped the run at `done`: saves that step
  unless the periodic save just did, waits for the save to finish, and says so."""
  if checkpoints.saved_step != done.step:
    checkpoints.save(done, force=True)
  checkpoints.checkpointer.close()
  progress.close()
  logging.warning(
    "%s received: saved step %d to %s and stopped; re-run the same command to resume",
    preemption.signal or "stop signal",
    done.step,
    checkpoints.checkpointer.root / str(done.step),
  )
