"""A checkpoint's parameters kept as a numpy file beside the compiled programs, so that a later run
decoding the same checkpoint reads them back without Orbax: a second decode.py run neither
imports Orbax nor restores through it (0.17 s + 0.14 s of the Transformer-tiny run in
docs/experiments.md, against 0.01 s for the copy).

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

import hashlib
import json
import os
import pathlib
import tempfile

import numpy as np
from absl import logging

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


def _flat(tree, prefix: str = "") -> dict[str, np.ndarray] | None:
  """{'a/b/c': array} of a tree of nested dicts with string keys; None for any other tree."""
  out = {}
  for key, value in tree.items():
    if not isinstance(key, str) or "/" in key or key.startswith("__"):
      return None
    if isinstance(value, dict):
      inner = _flat(value, f"{prefix}{key}/")
      if inner is None:
        return None
      out.update(inner)
    elif isinstance(value, np.ndarray):
      out[prefix + key] = value
    else:
      return None
  return out


def _nested(flat: dict[str, np.ndarray]) -> dict:
  """The nested dicts `_flat` flattened."""
  tree: dict = {}
  for path, value in flat.items():
    *parents, leaf = path.split("/")
    node = tree
    for name in parents:
      node = node.setdefault(name, {})
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
    self._writable = True

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
        os.utime(path)  # recently used: kept
        self.read += 1
        logging.vlog(1, "Parameters of %s read from their copy %s", checkpoint, path)
        return _nested(flat), meta
    params, meta = restore_params(checkpoint)
    self._write(path, params, meta)
    return params, meta

  def _write(self, path: pathlib.Path, params, meta: dict) -> None:
    """Writes the copy atomically (a reader sees the whole file or none), then drops all but the
    `KEEP` most recently used; a failure warns once per folder and decoding goes on."""
    flat = _flat(params)
    if flat is None or not self._writable:
      return
    tmp = None
    try:
      self.folder.mkdir(parents=True, exist_ok=True)
      fd, tmp = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
      with os.fdopen(fd, "wb") as f:
        np.savez(f, **flat, **{_META: np.array(json.dumps(meta))})
      os.replace(tmp, path)
      self.written += 1
      copies = sorted(self.folder.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime_ns)
      for old in copies[:-KEEP]:
        old.unlink(missing_ok=True)
    except (OSError, TypeError, ValueError) as e:  # an unwritable folder, meta not JSON
      self._writable = False
      logging.warning(
        "Parameters are not copied to %s (%s): the next run restores them again", self.folder, e
      )
      if tmp is not None and os.path.exists(tmp):
        os.unlink(tmp)
