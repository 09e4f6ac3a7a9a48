"""Loading a trained model for decoding: restored from its workdir (inference/restore.py), its
compiled searches' store opened, its parameters placed on the devices it decodes on.

    restored, programs = restore(workdir, "average:5", compilation_cache=True)
    loaded = place(restored, dtype="bfloat16")   # .model, .params, .devices, .rows
    loaded = place(restored, dtype="int8")       # .params with int8 matrices (model/quantize.py)

Loading changes no logger: `inference.quiet_library_logs()` hides, as the command lines do, the
library warnings that describe expected states (Orbax's on restoring a checkpoint without
metadata), below absl verbosity 2.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from core.cpu import native_dtype
from core.errors import UsageError
from inference.compilation_cache import enable as enable_compilation_cache
from inference.program_store import ProgramStore
from inference.restore import Restored, load_for_inference
from model.build import build_model
from model.config import INT8
from model.quantize import quantize_matrices

INT8_TYPES = ("transformer", "decoder_only")  # the models whose products are model/layers.py's
PROGRAMS = "programs"  # the subfolder of the compilation cache where compiled searches are kept


@dataclasses.dataclass(frozen=True)
class Loaded:
  """A restored model on its devices: `model` built with the decoding `dtype` (`dtype_reason`:
  why that one), `params` placed on every device of `devices` (replicated), `rows` the sharding
  that splits a batch's rows over them."""

  model: object
  dtype: str
  dtype_reason: str
  devices: list
  params: object
  rows: NamedSharding


def restore(
  workdir, checkpoint: str = "latest", *, compilation_cache: bool | str | None = False
) -> tuple[Restored, ProgramStore | None]:
  """(the restored checkpoint, the store of compiled searches or None). `checkpoint` is 'latest',
  a step number, 'average:<k>' (the mean of the last k checkpoints' parameters) or
  'ensemble:<k>' (the last k decoded together). `compilation_cache`: True (the per-user folder
  of compilation_cache.py) or a folder turns on JAX's persistent compilation cache for the whole
  process, and keeps the search programs in its `programs` subfolder (inference/program_store.py),
  so that a later process decoding the same model and settings neither compiles nor traces its
  searches; 'off', False or None turn both off. JAX's cache takes effect only before the
  process's first compilation."""
  programs = None
  if compilation_cache is not False and compilation_cache is not None:
    where = enable_compilation_cache(None if compilation_cache is True else str(compilation_cache))
    programs = None if where is None else ProgramStore(where / PROGRAMS)
  return load_for_inference(workdir, checkpoint), programs


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
    params = quantize_matrices(params, int(restored.ensemble))
  params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
  rows = NamedSharding(mesh, PartitionSpec("batch"))
  return Loaded(build_model(model_cfg), model_cfg.dtype, reason, list(devices), params, rows)
