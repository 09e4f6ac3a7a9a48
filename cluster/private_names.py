"""Whether the private names an adapter uses (cluster/jax_private.py, cluster/orbax_private.py)
are still where it reads them."""

from __future__ import annotations

import importlib


def missing(names) -> list[str]:
  """'module.attribute' of each (module, dotted attribute path) of `names` that cannot be
  imported or reached."""
  gone = []
  for module, path in names:
    try:
      found = importlib.import_module(module)
      for attribute in path.split("."):
        found = getattr(found, attribute)
    except (ImportError, AttributeError):
      gone.append(f"{module}.{path}")
  return gone
