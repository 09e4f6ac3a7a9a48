"""JAX's persistent compilation cache for decoding: a second run of the same model and settings
loads its compiled programs from disk instead of compiling them again (on a CPU, most of a small
file's wall time: docs/results.md, "Decoding a file", first run against second).

    from inference import compilation_cache
    compilation_cache.enable()               # before anything compiles; returns the folder
    compilation_cache.enable("off")          # or "", "none": no persistent cache

The folder is, first to last: the `path` given; `$JAX_COMPILATION_CACHE_DIR` when the environment
sets it (JAX's own variable, e.g. the tests'); `$XDG_CACHE_HOME/attention-jax/jax`, else
`~/.cache/attention-jax/jax`. Every program is cached whatever its size or compile time (JAX by
default skips those compiled in under a second), unless the environment sets
`JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS` / `JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES`. The
cache is keyed by the program, the JAX version and the machine, never by the parameters (an
argument of every program here), so a retrained model of the same shape reuses it. Nothing evicts
old entries: deleting the folder at any time is safe. decode.py turns it on (`--compilation_cache`);
bench.py never does, so its `compile_s` stays a real compilation. `Translator.load` keeps its
compiled searches in the folder's `programs` subfolder as well (inference/program_store.py), so a
second run does not even trace them.
"""

from __future__ import annotations

import os
import pathlib

import jax

ENV = "JAX_COMPILATION_CACHE_DIR"
OFF = ("", "off", "none")
_MINIMUMS = (  # (JAX option, its environment variable, the value set here)
  ("jax_persistent_cache_min_compile_time_secs", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", 0.0),
  ("jax_persistent_cache_min_entry_size_bytes", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", -1),
)


def default_folder(environ=os.environ) -> pathlib.Path:
  """The per-user folder: `$XDG_CACHE_HOME/attention-jax/jax`, else `~/.cache/attention-jax/jax`."""
  base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(base) / "attention-jax" / "jax"


def folder(path: str | None = None, environ=os.environ) -> pathlib.Path | None:
  """The folder `enable(path)` uses, or None when the cache is off."""
  if path is None:
    path = environ.get(ENV)
    if path is None:
      return default_folder(environ)
  return None if path.strip().lower() in OFF else pathlib.Path(path).expanduser()


def enable(path: str | None = None, environ=os.environ) -> pathlib.Path | None:
  """Turns the persistent compilation cache on in `folder(path)` (off for 'off', 'none' or '');
  returns the folder, or None when off. Call it before the process compiles anything: JAX reads
  the setting once, at its first compilation."""
  where = folder(path, environ)
  jax.config.update("jax_compilation_cache_dir", None if where is None else str(where))
  jax.config.update("jax_enable_compilation_cache", where is not None)
  if where is not None:
    for option, variable, value in _MINIMUMS:
      if variable not in environ:
        jax.config.update(option, value)
  return where
