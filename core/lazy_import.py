"""Modules imported on first use rather than with the module that names them, for the libraries
a command line may never need: decoding from a kept copy of the parameters
(inference/params_copy.py) reads no Orbax checkpoint, so it need not pay for importing Orbax
(docs/experiments.md).

    ocp = lazy_import.module("orbax.checkpoint")   # nothing imported yet
    ocp.Checkpointer(...)                          # imported here, once

Python's `importlib.util.LazyLoader`: the module object is in `sys.modules` at once and runs its
code at its first attribute access, so `import` statements elsewhere get the same module. Touch
it first from one thread (Python 3.11's LazyLoader is not thread-safe): here the main thread's
checkpoint reads and writes do, before any thread of Orbax's exists.
"""

from __future__ import annotations

import importlib.util
import sys
import types


def module(name: str) -> types.ModuleType:
  """`name` (a dotted module path), imported when an attribute of it is first used; the module
  itself when it is imported already. ModuleNotFoundError at once when it is not installed."""
  if name in sys.modules:
    return sys.modules[name]
  spec = importlib.util.find_spec(name)
  if spec is None:
    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
  spec.loader = importlib.util.LazyLoader(spec.loader)
  found = importlib.util.module_from_spec(spec)
  sys.modules[name] = found
  spec.loader.exec_module(found)
  return found
