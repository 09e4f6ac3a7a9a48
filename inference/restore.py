"""What decoding needs from a workdir alone: config, parameters and vocabulary, restored onto the
host (numpy) so that any devices can take them, from the newest checkpoint, a given step, the mean
of the last k checkpoints (`average:<k>`) or the last k stacked for ensemble decoding
(`ensemble:<k>`). Reads without the workdir's lock: a running training does not block decoding.
Of a checkpoint's state only the parameters are read (training/checkpoint.py `restore_params`):
Orbax is asked for that subtree alone, so the optimizer's moments and counters (two thirds of a
training checkpoint) are never read.

    restored = load_for_inference("runs/m30k", "average:5")
    restored.config, restored.params, restored.vocab, restored.steps
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging

from core.errors import ArgumentError, UsageError
from data.tokenizer import load_matching, run_vocab_files
from training.average import AVERAGE_DIR, average_params, report_average
from training.checkpoint import (
  available_steps,
  checkpoint_dir,
  choose_steps,
  describe_workdir,
  restore_params,
)
from training.compatibility import config_from_meta


@dataclasses.dataclass
class Restored:
  """What decoding needs from a workdir: `steps` lists the checkpoints used, `step` is the newest.
  With `ensemble` the params are their trees stacked on a leading axis
  (`inference.generator.Generator(..., ensemble=True)`), else one tree (their mean when several)."""

  config: ml_collections.ConfigDict
  params: Any
  step: int
  vocab: Any
  steps: tuple[int, ...] = ()
  ensemble: bool = False


def load_for_inference(workdir, checkpoint: str = "latest") -> Restored:
  """Config, parameters (host numpy; put them on any devices), step and vocabulary from a
  workdir alone.

  checkpoint: 'latest', a step number, 'average:<k>' (mean of the last k checkpoints'
  parameters, or the file `python -m cli.average` wrote for them), or 'ensemble:<k>' (the
  last k checkpoints' parameters stacked, decoded as an ensemble).
  """
  workdir = pathlib.Path(workdir).absolute()
  steps = available_steps(workdir)
  if not steps:
    raise FileNotFoundError(
      f"no checkpoint in {checkpoint_dir(workdir)}; {describe_workdir(workdir)}"
    )
  checkpoint = str(checkpoint)
  try:
    chosen = choose_steps(steps, checkpoint)
  except ValueError as e:
    raise ArgumentError("checkpoint", checkpoint, str(e)) from None

  ensemble = checkpoint.startswith("ensemble:")
  params = None
  avg_file = workdir / AVERAGE_DIR / f"last{len(chosen)}"
  if not ensemble and len(chosen) > 1 and (avg_file / "state").exists():
    averaged, meta = restore_params(avg_file)
    if meta.get("averaged_steps") == chosen:
      params = averaged
  if params is None:
    trees = []
    for s in chosen:
      p, meta = restore_params(checkpoint_dir(workdir) / str(s))
      trees.append(p)
    if ensemble:
      params = jax.tree_util.tree_map(lambda *xs: np.stack(xs), *trees)
    else:
      params = trees[0] if len(trees) == 1 else average_params(trees)
  config = config_from_meta(meta)
  if ensemble:
    logging.info("Ensemble of %d checkpoints: steps %s", len(chosen), ", ".join(map(str, chosen)))
  elif len(chosen) > 1:
    report_average(chosen, config.get("checkpoint_every_steps"))
  return Restored(
    config=config,
    params=params,
    step=chosen[-1],
    vocab=_training_vocab(workdir, config, meta.get("vocab")),
    steps=tuple(chosen),
    ensemble=ensemble,
  )


def _training_vocab(workdir: pathlib.Path, config, fingerprint: str | None):
  """The vocabulary the checkpoint was trained with: the workdir's vocab.model / vocab.json (train
  copies data.vocab_path there), else data.vocab_path; the one whose fingerprint the checkpoint
  recorded (older checkpoints record none: the first found)."""
  paths = run_vocab_files(workdir, config.data)
  if not paths:
    raise FileNotFoundError(
      f"no vocabulary (vocab.model or vocab.json) in {describe_workdir(workdir)}"
      + (
        f", and data.vocab_path={config.data.vocab_path} does not exist"
        if config.data.get("vocab_path")
        else ""
      )
    )
  vocab, found = load_matching(paths, fingerprint)
  if vocab is not None:
    return vocab
  raise UsageError(
    f"the checkpoints in {checkpoint_dir(workdir)} were trained with vocabulary "
    f"{fingerprint}, but {'; '.join(found)}: decoding with another vocabulary "
    f"would give wrong words; put the run's vocabulary file back"
  )
