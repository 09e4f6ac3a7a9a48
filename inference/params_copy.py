"""A checkpoint's parameters kept as a numpy file beside the compiled programs, so that a later run
decoding the same checkpoint reads them back without Orbax: a second decode.py run neither
imports Orbax nor restores through it (docs/experiments.md has the seconds saved).

    copies = ParamsCopies(folder)                  # inference/restore.py: the compilation cache's
    params, meta = copies.restore(step_folder)     # the copy, or restore_params and a new copy

A copy is named by a digest of the checkpoint folder's real path and of the name, size and
modification time of every file in it, so a checkpoint written again (the same step saved anew, or
another run's in its place) gets a new copy, never an old one. The file is an uncompressed `.npz`
(no pickles): each parameter under its path, and the checkpoint's meta as JSON. A copy that
cannot be read back is restored from the checkpoint again and replaced, with a warning; a folder
that cannot be written to decodes anyway, with one warning. Only the `KEEP` most recently used
copies are kept (each is the size of the parameters); deleting the folder at any time is safe.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib

import numpy as np
from absl import logging

from inference.program_store import KeptFolder
from training.checkpoint import restore_params

KEEP = 4  # copies kept, the most recently used
SUFFIX = ".npz"
_META = "__meta__"  # the entry holding the checkpoint's meta (JSON); parameter paths have no "__"


def _fingerprint(folder: pathlib.Path) -> str:
  """sha256 of the folder's real path and of each file's relative path, size and mtime."""
  root = folder.resolve()
  digest = hashlib.sha256(str(root).encode() + b"\0")
  for path in sorted(p for p in root.rglob("*") if p.is_file()):
    stat = path.stat()
    digest.update(f"{path.relative_to(root)}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
  return digest.hexdigest()


def _flat(params) -> dict[str, np.ndarray] | None:
  """{'a/b/c': array} of nested dicts of numpy arrays with plain names; None for any other tree
  (not copied). Empty dicts are left out."""
  flat = {}

  def walk(node, path: str) -> bool:
    for name, child in node.items():
      if not isinstance(name, str) or "/" in name or name.startswith("__"):
        return False
      if isinstance(child, dict):
        if not walk(child, f"{path}{name}/"):
          return False
      elif isinstance(child, np.ndarray):
        flat[path + name] = child
      else:
        return False
    return True

  return flat if isinstance(params, dict) and walk(params, "") else None


def _nested(flat: dict[str, np.ndarray]) -> dict:
  """`_flat`'s inverse: {'a/b/c': array} -> {'a': {'b': {'c': array}}}."""
  tree: dict = {}
  for name, value in flat.items():
    *parents, leaf = name.split("/")
    node = tree
    for parent in parents:
      node = node.setdefault(parent, {})
    node[leaf] = value
  return tree


class ParamsCopies:
  """A folder of parameter copies: `restore(folder)` is `training.checkpoint.restore_params`
  (params, meta), read from a copy when there is one. Counts: `read` (copies read back) and
  `written`."""

  def __init__(self, folder):
    self.folder = pathlib.Path(folder)
    self.read = 0
    self.written = 0
    self._kept = KeptFolder(folder, "Parameter copies", "the next run restores them again")

  def restore(self, checkpoint) -> tuple[dict, dict]:
    """(params, meta) of the checkpoint folder `checkpoint` (a training step's or an average's),
    the parameters as host numpy arrays, as `restore_params` gives them."""
    checkpoint = pathlib.Path(checkpoint)
    path = self.folder / f"{_fingerprint(checkpoint)[:40]}{SUFFIX}"
    if path.exists():
      try:
        with np.load(path, allow_pickle=False) as stored:
          flat = {name: stored[name] for name in stored.files}
        meta = json.loads(str(flat.pop(_META)))
      except Exception as e:  # a file cut short or damaged: read the checkpoint again
        logging.warning(
          "Parameter copy %s could not be read (%s); restoring %s", path, e, checkpoint
        )
      else:
        with contextlib.suppress(OSError):  # a read-only folder: the copy still serves
          os.utime(path)  # recently used: kept
        self.read += 1
        logging.vlog(1, "Parameters of %s read from their copy %s", checkpoint, path)
        return _nested(flat), meta
    params, meta = restore_params(checkpoint)
    self._write(path, params, meta)
    return params, meta

  def _write(self, path: pathlib.Path, params, meta: dict) -> None:
    """Writes the copy (`KeptFolder.write`), then drops all but the `KEEP` most recently used."""
    flat = _flat(params)
    if flat is None:
      return
    fill = lambda f: np.savez(f, **flat, **{_META: np.array(json.dumps(meta))})
    if not self._kept.write(path, fill):  # meta that is not JSON fails here too, with a warning
      return
    self.written += 1
    try:
      copies = sorted(self.folder.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime_ns)
      for old in copies[:-KEEP]:
        old.unlink(missing_ok=True)
    except OSError as e:  # another process evicting at the same time: the next run tries again
      logging.warning("Old parameter copies in %s not removed (%s)", self.folder, e)
