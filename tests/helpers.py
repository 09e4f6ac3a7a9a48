"""Helpers shared by tests: train a tiny run and read back what it saved; count compilations."""

import json
import pathlib

import jax
import numpy as np

from training import checkpoint as ckpt
from training.loop import train


def train_run(config, workdir):
  return train(config, pathlib.Path(workdir))


def train_losses(workdir) -> dict:
  """{step: loss} of the train records in `<workdir>/metrics.jsonl`."""
  recs = [
    json.loads(line) for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()
  ]
  return {r["step"]: r["loss"] for r in recs if r["split"] == "train"}


def saved_params(workdir, step):
  state, _ = ckpt.restore(ckpt.checkpoint_dir(workdir) / str(step))
  return state["params"]


def assert_trees_equal(a, b):
  la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


class Compilations:
  """Counts the XLA compilations of jitted functions named `name` while in the `with` block
  (JAX's public monitoring events; a persistent-cache hit still counts)."""

  EVENT = "/jax/core/compile/backend_compile_duration"

  def __init__(self, name: str):
    self.name, self.count = name, 0

  def _listen(self, event, duration, **kwargs):
    if event == self.EVENT and kwargs.get("fun_name") == self.name:
      self.count += 1

  def __enter__(self):
    jax.monitoring.register_event_duration_secs_listener(self._listen)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self._listen)
