"""Checkpoint averaging (the paper evaluates the mean of the last 5 base / 20 big checkpoints).

    python -m cli.average --workdir=runs/base --last=5      # the command line (cli/average.py)
    python decode.py --workdir=runs/base --checkpoint=average:5 ...

Writes `<workdir>/averaged/last<k>`, which decode.py loads for `--checkpoint=average:<k>` (the
mean is computed on the fly when that file is missing). Reads the checkpoints without the
workdir's lock, so it may run beside training.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import numpy as np
from absl import logging

from core import lazy_import
from core.errors import ArgumentError
from training.checkpoint import (
  available_steps,
  checkpoint_dir,
  describe_workdir,
  restore_params,
  with_param_shapes,
)
from training.compatibility import config_from_meta

ocp = lazy_import.module("orbax.checkpoint")  # imported on first use: see training/checkpoint.py

AVERAGE_DIR = "averaged"


def average_params(param_trees: list) -> Any:
  """Element-wise mean of parameter trees (float64 accumulation, cast back to each dtype)."""
  if not param_trees:
    raise ValueError("average_params: no parameter trees given")
  return jax.tree_util.tree_map(
    lambda *xs: np.mean(np.stack([np.asarray(x, np.float64) for x in xs]), axis=0).astype(
      np.asarray(xs[0]).dtype
    ),
    *param_trees,
  )


def report_average(chosen: list[int], interval: int | None = None) -> None:
  """Logs the steps being averaged; warns when they are not consecutive saves: with the run's
  `checkpoint_every_steps` known, every gap must be that interval except the last, which may be
  shorter (a run's end off the interval); without it, the gaps before the last must agree. Either
  way an old checkpoint kept by checkpoint.keep_best, or a gap in the saves, is among them."""
  logging.info("averaging the parameters of steps %s", ", ".join(map(str, chosen)))
  gaps = [b - a for a, b in zip(chosen[:-1], chosen[1:])]
  if interval:
    uneven = any(g != interval for g in gaps[:-1]) or (gaps and gaps[-1] > interval)
  else:
    uneven = len(set(gaps[:-1])) > 1
  if uneven:
    logging.warning(
      "averaging steps %s: they are not evenly spaced (a checkpoint kept by "
      "checkpoint.keep_best, or a gap in the saves, is among them); check that these "
      "are the checkpoints you mean",
      ", ".join(map(str, chosen)),
    )


def write_average(workdir, last: int) -> pathlib.Path:
  """Averages the last `last` checkpoints' parameters into `<workdir>/averaged/last<k>`,
  which `load_for_inference(workdir, 'average:<k>')` then loads."""
  workdir = pathlib.Path(workdir).absolute()
  if int(last) < 1:
    raise ArgumentError("last", last, "the number of checkpoints to average must be >= 1")
  steps = available_steps(workdir)
  if len(steps) < last:
    raise ArgumentError(
      "last",
      last,
      f"only {len(steps)} checkpoints in {checkpoint_dir(workdir)} "
      f"(steps {', '.join(map(str, steps)) or 'none'}); {describe_workdir(workdir)}",
    )
  chosen = steps[-last:]
  trees, meta = [], None
  for s in chosen:
    p, meta = restore_params(checkpoint_dir(workdir) / str(s))
    trees.append(p)
  report_average(chosen, config_from_meta(meta).get("checkpoint_every_steps"))
  averaged = {"params": average_params(trees)}
  meta = with_param_shapes(dict(meta, averaged_steps=chosen), averaged)
  out = workdir / AVERAGE_DIR / f"last{last}"
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    ckptr.save(
      out,
      args=ocp.args.Composite(state=ocp.args.StandardSave(averaged), meta=ocp.args.JsonSave(meta)),
      force=True,
    )
  return out
