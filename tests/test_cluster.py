"""cluster/: the arguments of a multi-process job checked before any wait, a run without a
cluster is one process, the private JAX names it needs still there, and a library thread ends the
process only through the command line's exit (core/ending.py). The jobs themselves:
tests/test_multihost.py and tests/test_process_loss.py."""

import os
import signal
import subprocess
import sys
import tomllib

import jax
import pytest
from packaging.requirements import Requirement

from cli.exit import ending_line
from cluster import jax_private
from cluster.distributed import initialize_distributed
from core import ending
from tests.helpers import REPO


def test_the_private_jax_names_exist():
  """A JAX upgrade that moves a private name cluster/ uses fails here, naming it (then update
  cluster/jax_private.py and pyproject.toml's bound on jax)."""
  missing = jax_private.missing()
  assert not missing, (
    f"jax {jax.__version__} lacks {', '.join(missing)}: update cluster/jax_private.py"
  )


def test_a_moved_private_name_is_named(monkeypatch):
  monkeypatch.setattr(jax_private, "NAMES", (("jax._src.distributed", "no_such_name"),))
  assert jax_private.missing() == ["jax._src.distributed.no_such_name"]
  monkeypatch.setattr(jax_private, "NAMES", (("jax._src.no_such_module", "x"),))
  assert jax_private.missing() == ["jax._src.no_such_module.x"]


def test_jax_is_bounded_to_the_minor_version_tested():
  """pyproject.toml bounds jax below the next minor version (a release may move the private
  names), and the installed one, the one tested, is in the range."""
  project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
  (spec,) = [Requirement(r) for r in project["dependencies"] if Requirement(r).name == "jax"]
  assert any(s.operator == "<" for s in spec.specifier), spec
  assert spec.specifier.contains(jax.__version__), (spec, jax.__version__)


@pytest.mark.parametrize(
  "args, words",
  [
    (("127.0.0.1:1", 2, 2), r"process_id=2: must be in \[0, num_processes=2\)"),
    (("127.0.0.1:1", 2, None), "coordinator_address, num_processes and process_id must be given"),
    (("nohost", 2, 0), "coordinator_address='nohost': expected host:port"),
  ],
)
def test_distributed_arguments_are_checked_before_waiting(args, words):
  """Bad arguments are an error naming them at once (not a failure to join after the timeout)."""
  with pytest.raises(ValueError, match=words):
    initialize_distributed(*args, timeout_s=1)


def test_without_flags_or_a_cluster_a_run_is_one_process():
  """No flags and no cluster environment (no SLURM, Open MPI, Kubernetes or TPU variables): JAX's
  own detection, through its public API, finds nothing to join and the run is one process."""
  env = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(("SLURM_", "OMPI_", "PMI_", "KUBERNETES_", "TPU_", "JAX_COORDINATOR"))
  }
  code = (
    "from cluster.distributed import initialize_distributed\n"
    "initialize_distributed(None, None, None, timeout_s=5)\n"
    "import jax\n"
    "print(jax.process_count(), jax.distributed.is_initialized())\n"
  )
  out = subprocess.run(
    [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
  )
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split() == ["1", "False"]


_ENDING = """
import threading, time
from cli.exit import ending_line
from core import ending
ending.on_end(lambda: print("cleaned", flush=True))
ending.install(ending_line("prog.py"))
threading.Thread(target=ending.end_process, args=(3, "why it ends")).start()
time.sleep(60)  # the main thread busy: the other thread ends the process
print("not reached")
"""


def test_a_thread_ends_the_process_through_the_command_line_exit():
  """With the command line's exit installed, a thread ends the process at once: the callbacks
  first, then `<prog>: error: <why>` and the status."""
  out = subprocess.run(
    [sys.executable, "-c", _ENDING], cwd=REPO, capture_output=True, text=True, timeout=60
  )
  assert out.returncode == 3
  assert out.stdout == "cleaned\n"
  assert out.stderr == "prog.py: error: why it ends\n"


def test_without_a_command_line_the_main_thread_is_interrupted(capfd):
  """Called from Python (nothing installed), ending writes the line and interrupts the main
  thread (its SIGINT handler: Python's own here, as in a plain interpreter) instead of exiting the
  interpreter; the exit installed is put back."""
  previous = ending.install(None)
  handler = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    with pytest.raises(KeyboardInterrupt):
      ending.end_process(1, "a process was lost")
      for _ in range(100):  # the interrupt arrives between bytecodes
        sum(range(1000))
    assert capfd.readouterr().err == "a process was lost\n"
    assert ending.install(ending_line("x")) is None
  finally:
    ending.install(previous)
    signal.signal(signal.SIGINT, handler)
