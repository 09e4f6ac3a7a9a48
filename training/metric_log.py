"""Training metrics: the train record of a log window (summed on device, averaged once per
record), and where records go: stdout (absl logging), `<workdir>/metrics.jsonl` and TensorBoard
event files. Only process 0 writes; other processes get a silent writer."""

from __future__ import annotations

import functools
import json
import math
import os
import pathlib

import jax
import jax.numpy as jnp
from absl import logging

from core.progress import fmt


def _plain(value):
  try:
    value = float(value)
  except (TypeError, ValueError):
    return value
  return value if math.isfinite(value) else None if math.isnan(value) else value


class MetricsWriter:
  """Writes one record per call: `{"step": s, "split": "train"|"eval", <metric>: value, ...}`
  as a JSON line, TensorBoard scalars (`<split>/<metric>`) and a log line. A disabled writer
  (processes other than 0) writes no file and logs only the loss."""

  def __init__(self, workdir: str | os.PathLike, enabled: bool = True, tensorboard: bool = True):
    self.enabled = enabled
    self._jsonl = None
    self._tb = None
    if not enabled:
      return
    workdir = pathlib.Path(workdir)
    self._jsonl = open(workdir / "metrics.jsonl", "a", encoding="utf-8")
    if tensorboard:
      from tensorboardX import SummaryWriter

      self._tb = SummaryWriter(str(workdir / "tensorboard"))

  def write(self, step: int, split: str, metrics: dict) -> None:
    if not self.enabled:  # other processes only log the line (useful to compare processes)
      logging.info("[%s] step %d: loss=%s", split, step, fmt(_plain(metrics.get("loss"))))
      return
    record = {"step": int(step), "split": split}
    record.update({k: _plain(v) for k, v in metrics.items()})
    self._jsonl.write(json.dumps(record) + "\n")
    self._jsonl.flush()
    if self._tb is not None:
      for k, v in record.items():
        if k not in ("step", "split") and isinstance(v, (int, float)):
          self._tb.add_scalar(f"{split}/{k}", v, int(step))
      self._tb.flush()
    shown = " ".join(f"{k}={fmt(v)}" for k, v in record.items() if k not in ("step", "split"))
    logging.info("[%s] step %d: %s", split, step, shown)

  def close(self) -> None:
    if self._jsonl:
      self._jsonl.close()
    if self._tb:
      self._tb.close()


# ----------------------------------------------------------------------------- train records
def accumulate(window, metrics):
  """Adds one step's train metrics to the running sums of the log window (on device: no sync).
  Loss, nll and accuracy are weighted by the step's target tokens; skipped (non-finite) steps
  are counted but not summed."""
  return _accumulator()(window, metrics)


@functools.cache
def _accumulator():
  def add(window, metrics):
    ok = metrics["nonfinite"] == 0
    tokens = metrics["tokens"].astype(jnp.float32)
    weight = jnp.where(ok, tokens, 0.0)
    step = {
      "loss": jnp.where(ok, metrics["loss"], 0.0) * weight,
      "nll": jnp.where(ok, metrics["nll"], 0.0) * weight,
      "correct": jnp.where(ok, metrics["accuracy"], 0.0) * weight,
      "weight": weight,
      "tokens": tokens,
      "grad_norm": jnp.where(ok, metrics["grad_norm"], 0.0),
      "finite_steps": ok.astype(jnp.float32),
      "steps": jnp.float32(1.0),
      "nonfinite": metrics["nonfinite"].astype(jnp.float32),
    }
    return step if window is None else jax.tree_util.tree_map(jnp.add, window, step)

  return jax.jit(add)


def window_means(window: dict, last: dict) -> dict:
  """The logged train record: token-weighted means of loss, nll and accuracy and the mean
  gradient norm over the window's finite steps (NaN when every step was skipped), mean target
  tokens per step, the number of skipped steps, and the last step's learning rate and streak."""
  nan = float("nan")
  weight, finite = float(window["weight"]), float(window["finite_steps"])
  steps = float(window["steps"])
  return {
    "loss": float(window["loss"]) / weight if weight else nan,
    "nll": float(window["nll"]) / weight if weight else nan,
    "accuracy": float(window["correct"]) / weight if weight else nan,
    "grad_norm": float(window["grad_norm"]) / finite if finite else nan,
    "tokens": float(window["tokens"]) / steps,
    "learning_rate": float(last["learning_rate"]),
    "nonfinite": float(window["nonfinite"]),
    "nonfinite_streak": float(last["nonfinite_streak"]),
    "steps": steps,
  }
