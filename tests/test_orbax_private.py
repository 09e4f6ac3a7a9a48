"""cluster/orbax_private.py: the private Orbax names it uses are still there and still hold what it
reads, and orbax-checkpoint and flax are bounded to the minor versions tested. The release of a
failed save's threads itself: tests/test_checkpoint.py."""

import importlib.metadata
import tomllib

import pytest
from packaging.requirements import Requirement

from cluster import orbax_private
from tests.helpers import REPO


def test_the_private_orbax_names_exist():
  """An Orbax upgrade that moves a private name fails here, naming it (then update
  cluster/orbax_private.py and pyproject.toml's bound on orbax-checkpoint)."""
  missing = orbax_private.missing()
  version = importlib.metadata.version("orbax-checkpoint")
  assert not missing, (
    f"orbax-checkpoint {version} lacks {', '.join(missing)}: update cluster/orbax_private.py"
  )


def test_a_signaling_thread_still_holds_what_the_release_reads():
  """The attributes `release_failed_save_threads` reads are set by the thread's constructor (the
  thread is built, never started)."""
  future = importlib.import_module(orbax_private.FUTURE)
  thread = future._SignalingThread(
    target=lambda: None, send_signals=[], receive_signals=[], timeout_secs=1, operation_id="0"
  )
  absent = [a for a in orbax_private.THREAD_ATTRIBUTES if not hasattr(thread, a)]
  assert not absent, f"orbax's _SignalingThread has no {', '.join(absent)}"
  assert thread._operation_id == "0" and list(thread._receive_signals) == []
  assert thread not in orbax_private.signaling_threads()  # not started: nothing to release


def test_a_moved_private_name_is_named(monkeypatch):
  monkeypatch.setattr(orbax_private, "NAMES", ((orbax_private.FUTURE, "no_such_name"),))
  assert orbax_private.missing() == [f"{orbax_private.FUTURE}.no_such_name"]
  monkeypatch.setattr(orbax_private, "NAMES", (("orbax.checkpoint._src.no_such_module", "x"),))
  assert orbax_private.missing() == ["orbax.checkpoint._src.no_such_module.x"]


@pytest.mark.parametrize("package", ["orbax-checkpoint", "flax"])
def test_orbax_and_flax_are_bounded_to_the_minor_version_tested(package):
  """pyproject.toml bounds each below its next minor version (a release may move the private
  names, or change what a checkpoint holds), and the installed one, the one tested, is in the
  range."""
  project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
  (spec,) = [Requirement(r) for r in project["dependencies"] if Requirement(r).name == package]
  assert any(s.operator == "<" for s in spec.specifier), spec
  assert spec.specifier.contains(importlib.metadata.version(package)), spec
