"""model/ is math only (the developers' guide): its modules import arrays, linen and each other,
never threads, files, the program store or the packages that orchestrate (inference/, training/,
data/, cli/), and keep no compiled programs in module-level caches. Read from the sources, so a
new import anywhere in model/ is checked too."""

import ast
import pathlib

MODEL = pathlib.Path(__file__).resolve().parent.parent / "model"
# The packages model/ may import, by their top-level name (absl: its logging only; core: the
# rules of the hyperparameters' values, model/config.py).
ALLOWED = {"__future__", "collections", "dataclasses", "functools", "math", "typing"}
ALLOWED |= {"jax", "flax", "numpy", "model"}
ALLOWED_MODULES = {"absl.logging", "core.rules"}
CACHES = ("lru_cache", "functools.cache", "@cache")


def _forbidden(source: str, name: str = "<source>") -> list[str]:
  """The modules `source` imports (at any depth) that model/ may not: `from a.b import c`
  names 'a.b' and 'a.b.c', and each must be allowed (the bare 'absl' of `from absl import
  logging` aside)."""
  names = []
  for node in ast.walk(ast.parse(source, name)):
    if isinstance(node, ast.Import):
      names += [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      assert node.level == 0, f"{name}: relative import"
      names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
  return sorted({n for n in names if n != "absl" and not _allowed(n)})


def _allowed(name: str) -> bool:
  root = name.split(".")[0]
  return root in ALLOWED or any(name == m or name.startswith(m + ".") for m in ALLOWED_MODULES)


def test_model_imports_no_threads_files_or_orchestration():
  sources = sorted(MODEL.glob("*.py"))
  assert len(sources) > 10 and (MODEL / "search.py") in sources
  found = {path.name: _forbidden(path.read_text(), path.name) for path in sources}
  assert {name: bad for name, bad in found.items() if bad} == {}


def test_the_check_sees_what_it_forbids():
  """The import rule on sources that break it: threads, files, flags, training."""
  for source in (
    "import concurrent.futures",
    "import threading",
    "from inference.program_store import ProgramStore",
    "import os",
    "from pathlib import Path",
    "import collections\nfrom absl import flags",
    "def f():\n  from training import evaluate",
  ):
    assert _forbidden(source), source
  assert _forbidden("from absl import logging\nimport jax.numpy as jnp") == []


def test_model_keeps_no_module_level_program_caches():
  """Compiled programs belong to objects (inference.generator.Generator, inference.continuous
  .PoolPrograms), so no module of model/ caches them for the whole process."""
  cached = [path.name for path in MODEL.glob("*.py") if any(c in path.read_text() for c in CACHES)]
  assert cached == []
