"""Restoring a workdir for decoding: its config, parameters and vocabulary read onto the host
(numpy) so that any devices can take them, its compiled searches' store opened, its parameters
placed on the devices it decodes on. Reads without the workdir's lock: a running training does
not block decoding. Of a checkpoint's state only the parameters are read
(training/checkpoint.py `restore_params`): Orbax is asked for that subtree alone, so the
optimizer's moments and counters (two thirds of a training checkpoint) are never read.

    restored, programs = restore(workdir, "average:5", compilation_cache=True)
    restored.config, restored.params, restored.vocab, restored.steps
    loaded = place(restored, dtype="bfloat16")   # .model, .params, .devices, .rows
    loaded = place(restored, dtype="int8")       # .params with int8 matrices (model/quantize.py)
    restored = load_for_inference("runs/m30k", "ensemble:5")   # the checkpoint alone

Checkpoints: the newest ('latest'), a given step, the mean of the last k (`average:<k>`) or the
last k stacked for ensemble decoding (`ensemble:<k>`). Restoring changes no logger:
`inference.quiet_library_logs()` hides, as the command lines do, the library warnings that
describe expected states (Orbax's on restoring a checkpoint without metadata), below absl
verbosity 2.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from core.cpu import native_dtype, uint8_int8_products
from core.errors import ArgumentError, UsageError
from data.tokenizer import load_matching, run_vocab_files
from inference.compilation_cache import enable as enable_compilation_cache
from inference.params_copy import ParamsCopies
from inference.program_store import ProgramStore
from model.build import DeferredModel
from model.config import INT8
from model.decoder_state import matrices_for_decoding
from model.distribution import useful_num_ids
from model.output_table import fold_tables
from model.quantize import quantize_matrices
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


def load_for_inference(
  workdir, checkpoint: str = "latest", *, read: Callable = restore_params
) -> Restored:
  """Config, parameters (host numpy; put them on any devices), step and vocabulary from a
  workdir alone.

  checkpoint: 'latest', a step number, 'average:<k>' (mean of the last k checkpoints'
  parameters, or the file `python -m cli.average` wrote for them), or 'ensemble:<k>' (the
  last k checkpoints' parameters stacked, decoded as an ensemble). `read`: (params, meta) of a
  checkpoint folder, `training.checkpoint.restore_params` or a `ParamsCopies`' `restore`.
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
    averaged, meta = read(avg_file)
    if meta.get("averaged_steps") == chosen:
      params = averaged
  if params is None:
    trees = []
    for s in chosen:
      p, meta = read(checkpoint_dir(workdir) / str(s))
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


INT8_TYPES = ("transformer", "decoder_only")  # the models whose products are model/layers.py's
PROGRAMS = "programs"  # the subfolders of the compilation cache where compiled searches and
PARAMS = "params"  # copies of the parameters (inference/params_copy.py) are kept


@dataclasses.dataclass(frozen=True)
class Loaded:
  """A restored model on its devices: `model` (a `model.build.DeferredModel`, built when first
  traced) with the decoding `dtype` (`dtype_reason`: why that one), `params` placed on every
  device of `devices` (replicated), `rows` the sharding that splits a batch's rows over them.
  `search_params`: `params` as the searches take them, made once here where each search program
  would make them again at every call: bfloat16's matrices cast
  (`model.decoder_state.matrices_for_decoding`), the output table with the searches' mask folded
  in (`model.output_table.fold_tables`)."""

  model: object
  dtype: str
  dtype_reason: str
  devices: list
  params: object
  rows: NamedSharding
  search_params: object


def restore(
  workdir,
  checkpoint: str = "latest",
  *,
  compilation_cache: bool | str | None = False,
  read_ahead: bool = False,
) -> tuple[Restored, ProgramStore | None]:
  """(the restored checkpoint, the store of compiled searches or None). `checkpoint` is 'latest',
  a step number, 'average:<k>' (the mean of the last k checkpoints' parameters) or
  'ensemble:<k>' (the last k decoded together). `compilation_cache`: True (the per-user folder
  of compilation_cache.py) or a folder turns on JAX's persistent compilation cache for the whole
  process, and keeps the search programs in its `programs` subfolder (inference/program_store.py),
  so that a later process decoding the same model and settings neither compiles nor traces its
  searches, and the parameters read in its `params` subfolder (inference/params_copy.py), so
  that it reads them without Orbax; 'off', False or None turn all three off. JAX's cache takes
  effect only before the process's first compilation. With `read_ahead` the store starts reading
  back, while the parameters are read, the programs the last run of this workdir and checkpoint
  asked for (`ProgramStore.read_ahead`); call its `finish()` once done translating, which also
  records this run's for the next."""
  programs, read = None, restore_params
  if compilation_cache is not False and compilation_cache is not None:
    where = enable_compilation_cache(None if compilation_cache is True else str(compilation_cache))
    if where is not None:
      programs, read = ProgramStore(where / PROGRAMS), ParamsCopies(where / PARAMS).restore
      if read_ahead:
        programs.read_ahead(f"{pathlib.Path(workdir).absolute()}\n{checkpoint}")
  try:
    return load_for_inference(workdir, checkpoint, read=read), programs
  except BaseException:  # a bad checkpoint: its error not held up by the reading ahead
    if programs is not None:
      programs.finish()
    raise


def place(restored: Restored, *, dtype: str | None = "auto", devices=None) -> Loaded:
  """`restored`'s model built for decoding and its parameters on `devices`: None = every local
  device of an accelerator (batches split over them), or one CPU device (several CPU devices
  share the same cores). `dtype='bfloat16'` decodes with bfloat16 matrices and float32 sums
  (docs/experiments.md, "Decoding speed", compares it with float32; on CPUs without bfloat16
  units it is slower), 'int8' quantizes every matrix once here and decodes with int8 products
  (model/quantize.py; Transformer models only), 'auto' chooses by the devices (core/cpu.py), None
  keeps the training config's model.dtype (`inference.translator.DTYPES` are the ones decoding
  offers)."""
  if devices is None:
    devices = jax.local_devices()
    devices = devices[:1] if devices[0].platform == "cpu" else devices
  model_cfg = restored.config.model.copy_and_resolve_references()
  reason = "as asked" if dtype is not None else "the training config's model.dtype"
  if dtype == "auto":
    dtype, reason = native_dtype(devices[0].platform)
  if dtype == INT8 and model_cfg.get("type", "transformer") not in INT8_TYPES:
    raise UsageError(
      f"dtype='int8': int8 products are for model.type {' or '.join(INT8_TYPES)}, "
      f"not {model_cfg.type!r}"
    )
  if dtype is not None:
    model_cfg.dtype = dtype
  mesh = Mesh(np.asarray(list(devices)), ("batch",))
  params = restored.params
  if dtype == INT8:  # once, on the host (numpy: nothing to compile), not in every decoding call
    uint8 = uint8_int8_products(devices[0].platform)
    params = quantize_matrices(params, int(restored.ensemble), uint8_inputs=uint8)
  model = DeferredModel(model_cfg)
  replicated = NamedSharding(mesh, PartitionSpec())
  # The searches' copy, made once on the host (numpy: nothing to compile): bfloat16's matrices
  # cast, the output table folded (model/output_table.py).
  ensemble = int(restored.ensemble)
  cast = params if dtype == INT8 else matrices_for_decoding(model, params, ensemble)
  cast = fold_tables(model, cast, useful_num_ids(restored.vocab.vocab_size, model_cfg.vocab_size))
  placed = jax.device_put(params, replicated)
  search_params = placed if cast is params else jax.device_put(cast, replicated)
  rows = NamedSharding(mesh, PartitionSpec("batch"))
  return Loaded(model, model_cfg.dtype, reason, list(devices), placed, rows, search_params)
