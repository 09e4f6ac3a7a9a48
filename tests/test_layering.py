"""The layers point one way: every module's imports (parsed, not run) against the rule below;
every command line defines its flags one way; only command lines define flags or end the process.

The rule, by top-level package (a module's imports of its own package are free; third-party
imports are free everywhere):

    core        nothing of this project: errors, progress, the logging policy (the bottom)
    model       core: math, no I/O, no flags
    cluster     core: joining a multi-process job, finding a lost process
    data        core, model
    configs     core, model            (the fields' catalog and rules describe the library)
    training    core, model, cluster, data, configs
    inference   core, model, cluster, data, configs, training
    analysis    core, model, cluster, data, configs, training, inference
    benchmark   the same: timing, sweeps, peers (bench.py's flags and processes are cli's)
    formats     the same: other engines' models in (Marian / OPUS-MT)
    cli         the library (every package above): the command lines' flags, mains and exit
    train.py, decode.py, bench.py: anything (the entry points)

It is checked on each module's whole import closure, followed transitively through the
project's modules (imports inside functions count): a library module (core ... benchmark) reaches
no module of cli/, however indirectly. No library module is a command line (`__main__` block):
the `python -m cli.<name>` modules are. The rule has no cycle, and neither has the graph of
modules.
"""

import ast
import importlib
import pathlib
import re
import tomllib

import pytest
from absl import flags

REPO = pathlib.Path(__file__).resolve().parents[1]
LIBRARY = (
  "core",
  "model",
  "cluster",
  "data",
  "configs",
  "training",
  "inference",
  "analysis",
  "benchmark",
  "formats",
)
ALLOWED = {
  "core": set(),
  "model": {"core"},
  "cluster": {"core"},
  "data": {"core", "model"},
  "configs": {"core", "model"},
  "training": {"core", "model", "cluster", "data", "configs"},
  "inference": {"core", "model", "cluster", "data", "configs", "training"},
  "analysis": {"core", "model", "cluster", "data", "configs", "training", "inference"},
  "benchmark": {"core", "model", "cluster", "data", "configs", "training", "inference"},
  "formats": {"core", "model", "cluster", "data", "configs", "training", "inference"},
  "cli": set(LIBRARY),
}
ENTRY_POINTS = ("train", "decode", "bench")


def _packages() -> list[str]:
  return sorted(p.parent.name for p in REPO.glob("*/__init__.py") if p.parent.name != "tests")


def _modules() -> dict[str, pathlib.Path]:
  """'package.module' (or an entry point's name) -> its file, for every module of the project."""
  found = {name: REPO / f"{name}.py" for name in ENTRY_POINTS}
  for package in _packages():
    for path in sorted((REPO / package).glob("*.py")):
      found[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
  return found


def _imports(path: pathlib.Path) -> set[str]:
  """Every module name `path` imports anywhere (top level, functions, `__main__` blocks)."""
  names = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      names.add(node.module)
      names.update(f"{node.module}.{alias.name}" for alias in node.names)
  return names


def _is_command_line(path: pathlib.Path) -> bool:
  """Whether the module has a top-level `if __name__ == "__main__":` block."""
  for node in ast.parse(path.read_text()).body:
    if isinstance(node, ast.If) and isinstance(node.test, ast.Compare):
      names = {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}
      texts = {n.value for n in ast.walk(node.test) if isinstance(n, ast.Constant)}
      if names == {"__name__"} and texts == {"__main__"}:
        return True
  return False


def _edges() -> dict[str, set[str]]:
  """module -> the project's modules it imports."""
  modules = _modules()
  return {
    name: {n for n in _imports(path) if n in modules and n != name}
    for name, path in modules.items()
  }


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One cycle of `graph` (a list of nodes, the first repeated at the end), or None."""
  state: dict[str, int] = {}  # 1: on the current path, 2: done
  path: list[str] = []

  def visit(node: str) -> list[str] | None:
    state[node] = 1
    path.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == 1:
        return path[path.index(nxt) :] + [nxt]
      if nxt not in state and (found := visit(nxt)):
        return found
    path.pop()
    state[node] = 2
    return None

  for node in sorted(graph):
    if node not in state and (found := visit(node)):
      return found
  return None


def package_graph() -> dict[str, set[str]]:
  """package -> the other packages its modules import (the entry points as themselves)."""
  graph: dict[str, set[str]] = {}
  for module, imported in _edges().items():
    source = module.split(".")[0]
    graph.setdefault(source, set()).update(
      n.split(".")[0] for n in imported if n.split(".")[0] != source
    )
  return graph


def _reachable(rule: dict[str, set[str]], package: str) -> set[str]:
  """The packages `package` may reach through the rule's arrows, itself included."""
  seen, todo = {package}, [package]
  while todo:
    for nxt in rule.get(todo.pop(), ()):
      if nxt not in seen:
        seen.add(nxt)
        todo.append(nxt)
  return seen


def _closure(edges: dict[str, set[str]], module: str) -> dict[str, list[str]]:
  """Every module `module` imports directly or through others: name -> one import path to it."""
  paths, todo = {module: [module]}, [module]
  while todo:
    current = todo.pop()
    for nxt in sorted(edges.get(current, ())):
      if nxt not in paths:
        paths[nxt] = paths[current] + [nxt]
        todo.append(nxt)
  del paths[module]
  return paths


def _against_the_rule(edges: dict[str, set[str]], rule: dict[str, set[str]]) -> list[str]:
  """'a.b reaches c.d (a.b -> ... -> c.d)' for every module whose import closure leaves the
  packages its own may reach; the entry points are free."""
  broken = []
  for module in sorted(edges):
    source = module.split(".")[0]
    if source in ENTRY_POINTS:
      continue
    allowed = _reachable(rule, source)
    for target, path in sorted(_closure(edges, module).items()):
      if target.split(".")[0] not in allowed:
        broken.append(f"{module} reaches {target} ({' -> '.join(path)})")
  return broken


def test_the_rule_covers_every_package_and_has_no_cycle():
  assert set(_packages()) == set(ALLOWED), "a new package: give it its place in ALLOWED"
  assert _cycle(ALLOWED) is None
  assert set(LIBRARY) <= set(ALLOWED)
  assert not any("cli" in _reachable(ALLOWED, p) for p in LIBRARY)
  assert not ({"data", "configs", "training", "cli"} & (_reachable(ALLOWED, "model")))
  assert _reachable(ALLOWED, "configs") == {"configs", "model", "core"}


def test_every_package_is_installed():
  """pyproject.toml's package list names every package (a new one missing there is absent from
  a non-editable install)."""
  project = tomllib.loads((REPO / "pyproject.toml").read_text())
  listed = {
    name.rstrip("*") for name in project["tool"]["setuptools"]["packages"]["find"]["include"]
  }
  assert listed == set(_packages()), listed ^ set(_packages())


def test_every_import_closure_follows_the_rule():
  broken = _against_the_rule(_edges(), ALLOWED)
  assert not broken, "imports against the layers (tests/test_layering.py):\n" + "\n".join(broken)


def test_the_closure_check_follows_imports_through_other_modules():
  """A library module that reaches cli through another package's module is caught, with the
  path; the same import from a command line is free."""
  edges = {
    "inference.restore": {"training.average"},
    "training.average": {"cli.app"},
    "cli.app": {"core.errors"},
    "core.errors": set(),
    "cli.average": {"training.average"},
  }
  assert _against_the_rule(edges, ALLOWED) == [
    "inference.restore reaches cli.app (inference.restore -> training.average -> cli.app)",
    "training.average reaches cli.app (training.average -> cli.app)",
  ]


def test_no_library_module_is_a_command_line():
  """`python -m` runs the command lines of cli/; a library module has no `__main__` block."""
  modules = _modules()
  assert not [
    m for m, path in modules.items() if m.split(".")[0] in LIBRARY and _is_command_line(path)
  ]
  command_lines = {m for m, path in modules.items() if _is_command_line(path)}
  assert {"cli.average", "cli.fetch", "cli.ctranslate2_translate"} <= command_lines


def test_the_modules_import_no_cycle():
  assert _cycle(_edges()) is None


@pytest.mark.parametrize(
  "graph, cycle",
  [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"x": {"y"}, "y": {"y"}}, ["y", "y"]),
  ],
)
def test_the_cycle_finder_finds_cycles(graph, cycle):
  assert _cycle(graph) == cycle


def test_the_checks_see_imports_anywhere_and_command_lines(tmp_path):
  """Imports inside functions and `__main__` blocks count; a `__main__` block makes a command
  line."""
  source = tmp_path / "m.py"
  source.write_text(
    "import a.b\nfrom c import d\ndef f():\n  from e.f import g\n"
    "if __name__ == '__main__':\n  import cli\n"
  )
  assert _imports(source) == {"a.b", "c", "c.d", "e.f", "e.f.g", "cli"}
  assert _is_command_line(source)
  source.write_text("if __name__ == 'x':\n  pass\n")
  assert not _is_command_line(source)


_DEFINING = ("DEFINE_", "define_config", "check_flag", "mark_flag_as_required", "adopt_module_key")


def _calls_outside_functions(tree: ast.Module) -> list[str]:
  """Names of the flag-defining calls a module makes outside any function (at import, or in its
  `__main__` block)."""
  found = []
  for node in tree.body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      continue
    for call in ast.walk(node):
      if isinstance(call, ast.Call):
        name = getattr(call.func, "attr", None) or getattr(call.func, "id", "")
        if name.startswith(_DEFINING):
          found.append(name)
  return found


def test_every_command_line_defines_its_flags_in_define_flags():
  """The one way (cli/app.py): a command line's flags are defined by its
  `define_flags(flag_values=flags.FLAGS)`, which its `__main__` block calls before `app.run`;
  nothing defines a flag at import, so a module imported for its library functions defines none.
  Each `define_flags` defines the whole command line into a FlagValues of its own."""
  command_lines = [
    name for name, path in _modules().items() if _is_command_line(path) and name != "model"
  ]
  assert {"bench", "cli.average", "cli.bleu_by_length"} <= set(command_lines)
  for name in command_lines:
    tree = ast.parse(_modules()[name].read_text())
    assert _calls_outside_functions(tree) == [], f"{name} defines flags outside define_flags()"
    main_block = [n for n in tree.body if isinstance(n, ast.If)][-1]
    calls = [getattr(c.func, "id", None) for c in ast.walk(main_block) if isinstance(c, ast.Call)]
    assert "define_flags" in calls, f"{name}: its __main__ block does not call define_flags()"
    module = importlib.import_module(name)
    defined = flags.FlagValues()
    module.define_flags(defined)
    assert len(list(defined)) > 0, name


def _outside_the_command_lines() -> dict[str, pathlib.Path]:
  """Every module but cli/'s and the entry points'."""
  return {
    name: path
    for name, path in _modules().items()
    if name.split(".")[0] not in ("cli", *ENTRY_POINTS)
  }


def _calls(tree: ast.AST, names: tuple[str, ...]) -> list[str]:
  """The calls in `tree` whose function's last name starts with one of `names` (`os._exit`,
  `flags.DEFINE_string`, ...), as 'name (line n)'."""
  found = []
  for call in ast.walk(tree):
    if isinstance(call, ast.Call):
      name = getattr(call.func, "attr", None) or getattr(call.func, "id", "")
      if name.startswith(names):
        found.append(f"{name} (line {call.lineno})")
  return found


def test_only_command_lines_end_the_process_or_define_flags():
  """`os._exit` is called in cli/ and the entry points only (the library asks core/ending.py),
  and flags are defined there only."""
  broken = []
  for name, path in sorted(_outside_the_command_lines().items()):
    tree = ast.parse(path.read_text())
    calls = _calls(tree, ("_exit", *_DEFINING))
    broken += [f"{name}: {c}" for c in calls if not c.startswith("check_flags ")]
  assert not broken, "\n".join(broken)


_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_]*")


def _flags_in_errors(tree: ast.AST) -> list[str]:
  """The `--flag` names in the text of the errors a module raises, as 'flag (line n)'."""
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Raise) and node.exc is not None:
      for part in ast.walk(node.exc):
        if isinstance(part, ast.Constant) and isinstance(part.value, str):
          found += [f"{m} (line {node.lineno})" for m in _FLAG.findall(part.value)]
  return found


def test_the_library_names_no_flag_in_its_errors():
  """Library errors name Python arguments; only cli/ and the entry points turn them into flags
  (cli/app.py error_line)."""
  broken = []
  for name, path in sorted(_outside_the_command_lines().items()):
    broken += [f"{name}: {flag}" for flag in _flags_in_errors(ast.parse(path.read_text()))]
  assert not broken, "\n".join(broken)
  caught = ast.parse("raise ValueError(f'--take_over_lock={x}: no')\nraise ValueError('a-b --c')")
  assert _flags_in_errors(caught) == ["--take_over_lock (line 1)", "--c (line 2)"]
