"""A model's parameter table without allocating it: `parameter_table(abstract_params(config))`
(the command line: cli/parameters.py)."""

from __future__ import annotations

import math

import jax


def parameter_table(params) -> list[tuple[str, tuple[int, ...], int]]:
  """(path, shape, size) for every parameter array of a (possibly abstract) params tree."""
  rows = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    rows.append((name, tuple(leaf.shape), math.prod(leaf.shape)))
  return rows
