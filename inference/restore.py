"""What decoding needs from a workdir alone: config, parameters and vocabulary, restored onto the
host (numpy) so that any devices can take them, from the newest checkpoint, a given step, the mean
of the last k checkpoints (`average:<k>`) or the last k stacked for ensemble decoding
(`ensemble:<k>`). Reads without the workdir's lock: a running training does not block decoding.
Of a checkpoint's state only the parameters are read (`restore_params`): Orbax is asked for that
subtree alone, so the optimizer's moments and counters (two thirds of a training checkpoint) are
never read.

    restored = load_for_inference("runs/m30k", "average:5")
    restored.config, restored.params, restored.vocab, restored.steps
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from typing import Any

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from core.errors import ArgumentError, UsageError, first_line
from data.tokenizer import VOCAB_JSON_NAME, VOCAB_MODEL_NAME, load_vocab
from training.average import AVERAGE_DIR, average_params, report_average
from training.checkpoint import available_steps, checkpoint_dir, describe_workdir
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
  if checkpoint == "latest":
    chosen = [steps[-1]]
  elif checkpoint.startswith(("average:", "ensemble:")):
    how, _, count = checkpoint.partition(":")
    try:
      k = int(count)
    except ValueError:
      raise ArgumentError(
        "checkpoint", checkpoint, f"expected {how}:<k> with k an integer"
      ) from None
    if k < 1 or k > len(steps):
      raise ArgumentError(
        "checkpoint",
        checkpoint,
        f"{len(steps)} checkpoints available (steps {', '.join(map(str, steps))})",
      )
    chosen = steps[-k:]
  elif checkpoint.isdigit():
    if int(checkpoint) not in steps:
      raise ArgumentError(
        "checkpoint",
        checkpoint,
        f"no checkpoint at step {checkpoint}; available steps: {', '.join(map(str, steps))}",
      )
    chosen = [int(checkpoint)]
  else:
    raise ArgumentError(
      "checkpoint", checkpoint, "expected latest, a step number, average:<k> or ensemble:<k>"
    )

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


def restore_params(folder) -> tuple[Any, dict]:
  """(params, meta) of one checkpoint folder (a training step's, or one `training.average`
  wrote), the parameters as host numpy arrays: Orbax restores the `params` subtree of the state
  only (a partial restore), reading none of the optimizer's arrays."""
  folder = pathlib.Path(folder)
  begin = time.perf_counter()
  with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
    saved = checkpointer.metadata(folder / "state")
  saved = getattr(saved, "item_metadata", saved)
  saved = getattr(saved, "tree", saved)
  if not isinstance(saved, dict) or "params" not in saved:  # Orbax gives no tree when damaged
    raise OSError(f"no readable parameter metadata in {folder / 'state'}")
  wanted = {"params": saved["params"]}
  as_numpy = jax.tree_util.tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), wanted)
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
    restored = checkpointer.restore(
      folder,
      args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(item=wanted, restore_args=as_numpy, partial_restore=True),
        meta=ocp.args.JsonRestore(),
      ),
    )
  params = restored["state"]["params"]
  arrays = jax.tree_util.tree_leaves(params)
  logging.vlog(
    1,
    "Read %d parameter arrays of %s (%s values, %.1f MB; no optimizer state) in %.2f s",
    len(arrays),
    folder,
    f"{sum(x.size for x in arrays):,}",
    sum(x.nbytes for x in arrays) / 1e6,
    time.perf_counter() - begin,
  )
  return params, restored["meta"]


def _training_vocab(workdir: pathlib.Path, config, fingerprint: str | None):
  """The vocabulary the checkpoint was trained with: the workdir's vocab.model / vocab.json (train
  copies data.vocab_path there), else data.vocab_path; the one whose fingerprint the checkpoint
  recorded (older checkpoints record none: the first found)."""
  paths = [workdir / n for n in (VOCAB_MODEL_NAME, VOCAB_JSON_NAME) if (workdir / n).is_file()]
  if config.data.get("vocab_path") and pathlib.Path(config.data.vocab_path).is_file():
    paths.append(pathlib.Path(config.data.vocab_path))
  if not paths:
    raise FileNotFoundError(
      f"no vocabulary (vocab.model or vocab.json) in {describe_workdir(workdir)}"
      + (
        f", and data.vocab_path={config.data.vocab_path} does not exist"
        if config.data.get("vocab_path")
        else ""
      )
    )
  found = []
  for path in paths:
    try:
      vocab = load_vocab(path)
    except Exception as e:  # noqa: BLE001 - a damaged or stale file: try the next one
      found.append(f"{path}: unreadable ({first_line(e)})")
      continue
    if fingerprint is None or vocab.fingerprint == fingerprint:
      return vocab
    found.append(f"{path}: {vocab.fingerprint}")
  raise UsageError(
    f"the checkpoints in {checkpoint_dir(workdir)} were trained with vocabulary "
    f"{fingerprint}, but {'; '.join(found)}: decoding with another vocabulary "
    f"would give wrong words; put the run's vocabulary file back"
  )
