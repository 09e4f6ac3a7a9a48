"""The training run's Orbax checkpoints in `<workdir>/checkpoints/<step>/`: save (async), resume
onto this run's devices, and what happens to damaged ones. Loading for decoding is
inference/restore.py; averaging is training/average.py; whether a config may continue a
checkpoint is training/compatibility.py.

A checkpoint holds `state` (params, Adam moments, step, the non-finite counter) and `meta`
(JSON: the config, the data iterator's position, the RNG seed, and the parameters' shapes, so that
decoding restores them without reading every array's metadata). The vocabulary file sits in the
workdir beside it. Orbax writes each step into a temporary folder and renames it when complete,
so a crash mid-save leaves the previous checkpoint intact; restore skips unfinished folders and
falls back past a checkpoint that cannot be read, with a warning naming it, and renames it to
`<step>.unreadable-<n>` so that the run can save that step again; when none can be restored it is
an error (never a silent fresh start). With `keep_best`, each evaluated checkpoint's BLEU is
written beside it, so the best survives restarts. A readable checkpoint
whose arrays do not fit the run's state (another model or optimizer layout) is an error naming the
arrays that differ, never a silent fresh start.

A save that fails (permission denied, disk full, an I/O error), synchronous or asynchronous, is
one RunError naming the step's folder and the system's reason, raised by the call that finds it:
`save`, `wait`, `close`, or `check`, which the loop calls at every step so that an asynchronous
save's failure stops the run within a step rather than at the next save. Orbax's threads of the
failed save are released (cluster/orbax_private.py), so the process exits at once (they would
otherwise keep it alive for Orbax's 300 s coordination timeout); the tracebacks Orbax logs on the
way (~300 lines) are dropped where Orbax raises the error again and cut to one line elsewhere by
the logging policy the command lines install (core/logs.py; kept whole with `--verbosity=1` or
ATTENTION_JAX_TRACEBACK=1). The unfinished step stays a temporary folder that restore skips: the
last finished checkpoint is untouched.
"""

from __future__ import annotations

import json
import pathlib
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from absl import logging

from cluster import orbax_private
from core import lazy_import
from core.errors import RunError, UsageError, first_line

CHECKPOINT_DIR = "checkpoints"
UNREADABLE_MARK = ".unreadable-"  # <step>.unreadable-<n>: set aside by a resume (_set_aside)

# Imported on first use: decoding from a kept copy of the parameters needs no Orbax
# (core/lazy_import.py).
ocp = lazy_import.module("orbax.checkpoint")


def checkpoint_dir(workdir) -> pathlib.Path:
  return pathlib.Path(workdir).absolute() / CHECKPOINT_DIR


def available_steps(workdir) -> list[int]:
  """The finished checkpoints' steps in `<workdir>/checkpoints`, oldest first."""
  return _step_dirs(checkpoint_dir(workdir))[0]


def describe_workdir(workdir: pathlib.Path) -> str:
  """'<workdir> contains: a, b/, ...' (or that it does not exist), for error messages."""
  if not workdir.exists():
    return f"{workdir} does not exist"
  entries = sorted(p.name + ("/" if p.is_dir() else "") for p in workdir.iterdir())
  return f"{workdir} contains: {', '.join(entries) if entries else 'nothing'}"


def _step_dirs(root: pathlib.Path) -> tuple[list[int], list[pathlib.Path]]:
  """(finished steps, unfinished/foreign folders) in a checkpoints folder."""
  steps, other = [], []
  if root.is_dir():
    for p in sorted(root.iterdir()):
      if p.is_dir() and p.name.isdigit():
        steps.append(int(p.name))
      else:
        other.append(p)
  return sorted(steps), other


class Checkpointer:
  """Saves and restores the training state and its metadata in `<workdir>/checkpoints`."""

  def __init__(self, workdir, *, keep: int = 5, keep_best: int = 0, async_save: bool = True):
    self.root = checkpoint_dir(workdir)
    pp = ocp.checkpoint_managers.preservation_policy
    policies = [pp.LatestN(n=max(int(keep), 1))]
    best = {}
    if keep_best:
      # BestN sorts ascending and keeps the last n: the highest BLEU.
      policies.append(
        pp.BestN(
          get_metric_fn=_bleu,
          reverse=False,
          n=int(keep_best),
          keep_checkpoints_without_metrics=False,
        )
      )
      # Orbax writes a checkpoint's metrics to disk only with best_fn set; without it they live in
      # memory and, after a restart, every older checkpoint looks unscored and the best is deleted.
      best = dict(best_fn=_bleu, best_mode="max")
      _set_aside_unreadable_metrics(self.root)
    self._options = ocp.CheckpointManagerOptions(
      preservation_policy=pp.AnyPreservationPolicy(policies),
      enable_async_checkpointing=async_save,
      create=True,
      **best,
    )
    self.manager = ocp.CheckpointManager(self.root, options=self._options)
    self._writing: int | None = None  # the step of the save that may still be in flight
    self._failed = False

  def save(self, step: int, state, meta: dict, metrics: dict | None = None, force=False) -> bool:
    """Starts writing `state` (a pytree of arrays) and `meta` (JSON-able) at `step`; returns
    while the write finishes in the background (async mode). RunError when this save, or the
    previous one still in flight, fails."""
    if self._writing is not None:
      self.wait()  # Orbax would wait for it too; a failure of it is named as its own
    meta = with_param_shapes(meta, state)
    try:
      saved = self.manager.save(
        int(step),
        args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
        metrics=metrics,
        force=force,
      )
    except Exception as e:  # noqa: BLE001 - any failure to write: one error naming the step
      raise self._save_failed(step, e) from e
    if saved:
      self._writing = int(step)
    else:
      logging.warning(
        "checkpoint at step %d was not written (Orbax's save policy declined it; "
        "existing steps: %s)",
        step,
        self.steps(),
      )
    return saved

  def wait(self):
    """Returns once the save in flight is finished; RunError when it failed."""
    try:
      self.manager.wait_until_finished()
    except Exception as e:  # noqa: BLE001 - see save
      raise self._save_failed(self._writing, e) from e
    self._writing = None

  def check(self):
    """RunError when an asynchronous save has failed; returns at once while one is in flight."""
    if self._writing is not None and not self.manager.is_saving_in_progress():
      self.wait()

  def _save_failed(self, step: int | None, error: Exception) -> RunError:
    """The RunError of a failed save, once Orbax's threads that still wait on it are released."""
    self._failed = True
    self._writing = None
    orbax_private.release_failed_save_threads()
    if isinstance(error, OSError) and error.strerror:
      reason = error.strerror + (f": {error.filename}" if error.filename else "")
    else:
      reason = first_line(error)
    folder = self.root / str(step) if step is not None else self.root
    earlier = [s for s in _step_dirs(self.root)[0] if s != step]
    return RunError(
      f"could not save checkpoint {folder} ({reason}); "
      + (
        f"the last finished checkpoint, {self.root / str(earlier[-1])}, is intact"
        if earlier
        else "there is no earlier checkpoint"
      )
      + ": fix the cause (disk space, permissions, the file system) and re-run the same command"
    )

  def steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def restore_latest(self, abstract_state, check_meta=None, explain=None):
    """Restores the newest readable checkpoint into `abstract_state` (ShapeDtypeStructs with
    shardings). `check_meta(meta)` may raise to refuse a checkpoint (e.g. another model shape);
    that error propagates, as does a ValueError when the saved arrays do not fit
    `abstract_state` (`explain(meta)` adds a hint to its message). Returns (step, state, meta),
    or None when there is no finished checkpoint; RuntimeError when there are some and none can
    be restored. Unreadable checkpoints newer than the one restored are set aside (`_set_aside`)."""
    steps, other = _step_dirs(self.root)
    for p in other:
      if UNREADABLE_MARK in p.name:
        logging.info("%s: a checkpoint set aside as unreadable by an earlier resume", p)
      else:
        logging.warning("skipping %s: not a finished checkpoint (an interrupted save?)", p)
    unreadable = []  # (folder, error) of newer checkpoints skipped
    found = None
    for step in reversed(steps):
      folder = self.root / str(step)
      try:
        meta = read_meta(folder)
        diffs = state_differences(folder, abstract_state)
      except Exception as e:  # noqa: BLE001 - unreadable metadata: fall back to the one before
        _raise_if_environmental(e, folder)
        unreadable.append((folder, first_line(e)))
        logging.warning(
          "skipping checkpoint %s: its metadata could not be read (%s)", folder, unreadable[-1][1]
        )
        continue
      if check_meta is not None:
        check_meta(meta)
      if diffs:
        hint = explain(meta) if explain is not None else ""
        raise UsageError(
          f"checkpoint {folder} does not fit this run's training state (no silent "
          f"re-initialisation; use a new workdir or the checkpoint's settings): "
          + "; ".join(diffs)
          + (f". {hint}" if hint else "")
        )
      try:
        state, meta = restore(folder, abstract_state)
      except Exception as e:  # noqa: BLE001 - corrupt or truncated: fall back to the one before
        _raise_if_environmental(e, folder)
        unreadable.append((folder, first_line(e)))
        logging.warning(
          "skipping checkpoint %s: it could not be read (%s)", folder, unreadable[-1][1]
        )
        continue
      found = (step, state, meta)
      break
    _agree_across_processes(found[0] if found else None, self.root)
    if found is None and unreadable:
      # Not a fresh start: checkpoints exist, and discarding the run silently would lose it.
      raise RunError(
        f"none of the {len(unreadable)} checkpoints in {self.root} could be restored (newest "
        f"first: "
        + "; ".join(f"{f.name}: {err}" for f, err in unreadable[:3])
        + "); fix the cause, or move them away to start afresh"
      )
    if unreadable:
      self._set_aside([f for f, _ in unreadable])
    return found

  def _set_aside(self, folders: list[pathlib.Path]) -> None:
    """Renames unreadable checkpoints newer than the restored one to `<step>.unreadable-<n>` (kept
    for inspection, no longer a step), so that the run can save those steps again: Orbax
    declines to save a step at or below the newest it knows."""
    if jax.process_index() == 0:
      for folder in folders:
        n = 0
        while (target := folder.with_name(f"{folder.name}{UNREADABLE_MARK}{n}")).exists():
          n += 1
        folder.rename(target)
        logging.warning("moved the unreadable checkpoint %s to %s", folder, target)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils

      multihost_utils.sync_global_devices("checkpoints set aside")
    self.manager.close()
    self.manager = ocp.CheckpointManager(self.root, options=self._options)

  def close(self):
    """Waits for the save in flight (RunError when it failed) and closes the manager."""
    if not self._failed:
      self.wait()
    try:
      self.manager.close()
    except Exception:  # noqa: BLE001 - after a failed save, already reported
      if not self._failed:
        raise


def _bleu(metrics) -> float:
  return metrics["bleu"]


def _set_aside_unreadable_metrics(root: pathlib.Path) -> None:
  """Renames a damaged `<step>/metrics/metrics` (the BLEU that `keep_best` ranks by) to
  `metrics.unreadable`: Orbax's manager reads every step's metrics when it starts and fails on one
  that is not JSON, where a missing one only makes that checkpoint unscored. Its state is kept."""
  if jax.process_index() == 0:
    for step in _step_dirs(root)[0]:
      f = root / str(step) / "metrics" / "metrics"
      try:
        if f.is_file():
          json.loads(f.read_text())
      except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        target = f.with_name("metrics.unreadable")
        f.replace(target)
        logging.warning(
          "checkpoint %s: its metrics file could not be read (%s); moved it to %s, "
          "so this checkpoint counts as unscored (keep_best will not keep it for its "
          "BLEU; its training state is untouched)",
          f.parent.parent,
          first_line(e),
          target,
        )
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("checkpoint metrics checked")


# Errors of the machine rather than the checkpoint: restoring elsewhere or later may succeed, so
# the checkpoint is neither skipped nor set aside.
_ENVIRONMENT_CODES = ("resource_exhausted", "unavailable", "deadline_exceeded", "out of memory")


def _raise_if_environmental(e: Exception, folder: pathlib.Path) -> None:
  if isinstance(
    e, (MemoryError, PermissionError, TimeoutError, ConnectionError, jax.errors.JaxRuntimeError)
  ) or any(code in str(e).lower() for code in _ENVIRONMENT_CODES):
    raise RunError(
      f"checkpoint {folder} could not be restored ({first_line(e)}): a problem "
      f"of this machine (memory, devices, file system), not a damaged checkpoint, "
      f"so nothing was skipped or moved; fix it and re-run"
    ) from e


def _agree_across_processes(step: int | None, root: pathlib.Path) -> None:
  """Several processes must resume the same step; one that could read less than another (a
  damaged file only it reads) stops them all with an error instead of a hang or a split run."""
  if jax.process_count() == 1:
    return
  from jax.experimental import multihost_utils

  steps = multihost_utils.process_allgather(np.int64(-1 if step is None else step))
  steps = [int(s) for s in np.ravel(steps)]
  if len(set(steps)) > 1:
    raise RunError(
      f"processes found different newest readable checkpoints in {root} "
      f"(by process: {steps}, -1 = none): a checkpoint is damaged for some of "
      f"them; move the damaged step folder away and re-run"
    )


def choose_steps(steps: list[int], choice: str) -> list[int]:
  """The checkpoints `choice` names among a workdir's `steps` (ascending): 'latest' (the newest),
  a step number, or '<how>:<k>' (the last k; how is average or ensemble). ValueError saying what
  is wrong otherwise (the caller names the argument)."""
  available = f"available steps: {', '.join(map(str, steps)) or 'none'}"
  how, _, count = choice.partition(":")
  if choice == "latest" and steps:
    return steps[-1:]
  if choice.isdigit():
    if int(choice) not in steps:
      raise ValueError(f"no checkpoint at step {choice}; {available}")
    return [int(choice)]
  if how in ("average", "ensemble") and count:
    if not count.isdigit():
      raise ValueError(f"expected {how}:<k> with k an integer")
    if not 1 <= int(count) <= len(steps):
      raise ValueError(f"{how}:{count} needs 1 to {len(steps)} checkpoints; {available}")
    return steps[-int(count) :]
  raise ValueError("expected latest, a step number, average:<k> or ensemble:<k>")


PARAM_SHAPES = "param_shapes"  # meta's key: {name: sub-tree, or a parameter's [shape]}


def with_param_shapes(meta: dict, state) -> dict:
  """`meta` with the shape tree of `state`'s params (a dict's "params" or a `.params`), which
  `restore_params` restores from; `meta` as it is when they are not nested dicts of arrays."""
  params = state.get("params") if isinstance(state, Mapping) else getattr(state, "params", None)
  shapes = _shape_tree(params)
  return meta if shapes is None else dict(meta, **{PARAM_SHAPES: shapes})


def _shape_tree(tree):
  """{name: sub-tree} of nested dicts, each array as its [shape]; None for anything else."""
  if hasattr(tree, "shape"):
    return [int(d) for d in tree.shape]
  if not isinstance(tree, Mapping) or not all(isinstance(k, str) for k in tree):
    return None
  out = {k: _shape_tree(v) for k, v in tree.items()}
  return None if any(v is None for v in out.values()) else out


def read_meta(folder) -> dict:
  """The `meta` JSON of checkpoint folder `folder`, as Orbax's JsonSave wrote it (OSError,
  ValueError when it cannot be read)."""
  return json.loads((pathlib.Path(folder) / "meta" / "metadata").read_text())


def _recorded_shapes(folder: pathlib.Path) -> dict | None:
  """The params' shape tree that meta recorded at save time (`_shape_tree`), or None (an older
  checkpoint, or meta unreadable: Orbax's metadata of the state is read instead)."""
  try:
    shapes = read_meta(folder).get(PARAM_SHAPES)
  except (OSError, ValueError, AttributeError):
    return None
  return shapes if isinstance(shapes, dict) else None


def restore_params(folder) -> tuple[Any, dict]:
  """(params, meta) of one checkpoint folder (a training step's, or one `training.average`
  wrote), the parameters as host numpy arrays: Orbax restores the `params` subtree of the state
  only (a partial restore), reading none of the optimizer's arrays. The subtree is the one meta
  recorded (`with_param_shapes`); for a checkpoint without it, Orbax's metadata of every array
  of the state, which takes longer. OSError when the arrays read do not have the shapes meta
  recorded."""
  folder = pathlib.Path(folder)
  begin = time.perf_counter()
  recorded = _recorded_shapes(folder)
  if recorded is not None:  # a leaf's value is not read: the restore args say what to make
    saved = {"params": jax.tree_util.tree_map(lambda _: 0, recorded, is_leaf=_is_shape)}
  else:
    saved = _state_metadata(folder)
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
  if recorded is not None and _shape_tree(params) != recorded:
    raise OSError(f"the parameters in {folder / 'state'} do not have the shapes meta recorded")
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


def _is_shape(x) -> bool:
  return isinstance(x, list)


def restore(path: pathlib.Path, abstract_state=None):
  """(state, meta) from one checkpoint folder. `abstract_state` gives shapes, dtypes and
  shardings (restore onto these devices); None restores numpy arrays on the host."""
  path = pathlib.Path(path)
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    if abstract_state is None:
      restored = ckptr.restore(
        path,
        args=ocp.args.Composite(
          state=ocp.args.PyTreeRestore(restore_args=_numpy_restore_args(path)),
          meta=ocp.args.JsonRestore(),
        ),
      )
    else:
      restored = ckptr.restore(
        path,
        args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
        ),
      )
  return restored["state"], restored["meta"]


def _path_names(path) -> str:
  """A pytree key path as 'opt_state/adam/mu/...' (dict keys, attributes and indices alike)."""
  parts = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return "/".join(parts)


def _leaf_shapes(tree) -> dict[str, tuple[int, ...]]:
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {_path_names(p): tuple(getattr(x, "shape", ()) or ()) for p, x in leaves}


def _state_metadata(path: pathlib.Path):
  with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as c:
    tree = c.metadata(pathlib.Path(path) / "state")
  tree = getattr(tree, "item_metadata", tree)
  return getattr(tree, "tree", tree)


def saved_shapes(path) -> dict[str, tuple[int, ...]]:
  """{'params/encoder/...': shape} of every array of the state saved in checkpoint folder `path`,
  read from its metadata alone."""
  return _leaf_shapes(_state_metadata(path))


def state_differences(path, abstract_state, limit: int = 4) -> list[str]:
  """How the state saved in checkpoint folder `path` differs from `abstract_state` (arrays
  missing, extra, or of another shape); [] when it fits. Reads only the checkpoint's metadata."""
  saved, wanted = _leaf_shapes(_state_metadata(path)), _leaf_shapes(abstract_state)
  if not saved:  # Orbax returns no tree, rather than raising, for damaged metadata
    raise OSError(f"no readable array metadata in {pathlib.Path(path) / 'state'}")

  def listed(what, names):
    names = sorted(names)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"{what}: {', '.join(names[:limit])}{more}"

  out = []
  if missing := wanted.keys() - saved.keys():
    out.append(listed("arrays the run needs but the checkpoint lacks", missing))
  if extra := saved.keys() - wanted.keys():
    out.append(listed("arrays in the checkpoint the run does not have", extra))
  shapes = [
    f"{k} {saved[k]} != {wanted[k]}"
    for k in sorted(saved.keys() & wanted.keys())
    if saved[k] != wanted[k]
  ]
  if shapes:
    out.append(listed("shapes (checkpoint != run)", shapes))
  return out


def _numpy_restore_args(path: pathlib.Path):
  tree = _state_metadata(path)
  return jax.tree_util.tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
