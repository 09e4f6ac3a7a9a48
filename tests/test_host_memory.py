"""cli/host_memory.py: glibc keeps XLA:CPU's freed buffers, so a step does not page-fault
its temporaries again; the environment's own malloc settings win."""

import os
import platform
import subprocess
import sys

import pytest

from cli import host_memory
from tests.helpers import REPO

pytestmark = pytest.mark.slow  # real command-line processes or trained workdirs

# A jitted function with 144 MB temporaries ([6144, 6144] float32: above glibc's largest mmap
# threshold, 32 MB, and a per-thread arena's 64 MB heap; x is narrow, 64 wide, so the matrix
# products take little time), called 5 times after its first call: prints whether the settings
# were applied and the minor page faults per call.
PROGRAM = """
import sys
from cli import host_memory
applied = host_memory.keep_freed_memory(single_arena=sys.argv[1] == "single")
import resource
import jax, jax.numpy as jnp
f = jax.jit(lambda x: (jnp.tanh(jnp.exp(x) @ x.T) @ x).sum())
x = jnp.full((6144, 64), 1e-3, jnp.float32)
f(x).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
  f(x).block_until_ready()
print(applied, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
"""


def _start(env_extra: dict, arenas: str = "single") -> subprocess.Popen:
  """PROGRAM in a new process (glibc's settings apply only at a process's start), with the
  environment's own malloc settings removed and `env_extra` set."""
  env = {
    k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"
  }
  env.update(JAX_PLATFORMS="cpu", **env_extra)
  env.pop("XLA_FLAGS", None)
  return subprocess.Popen(
    [sys.executable, "-c", PROGRAM, arenas],
    cwd=REPO,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )


def _faults(proc: subprocess.Popen) -> tuple[str, float]:
  """(whether the settings were applied, minor page faults per call) of a `_start`ed process."""
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 0, err[-2000:]
  applied, faults = out.split()
  return applied, float(faults)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")
def test_freed_temporaries_are_reused_not_faulted_again():
  """With the single arena kept, a call faults few pages; with glibc's defaults, and with the
  per-thread arenas, the temporaries are faulted afresh on every call. Each setting is a process
  of its own (its own page faults), the three run side by side."""
  procs = [_start({}), _start({"MALLOC_ARENA_MAX": "16"}), _start({}, arenas="per-thread")]
  try:
    (applied, kept), (default_applied, default), (thread_applied, per_thread) = map(_faults, procs)
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  assert applied == "True"
  # glibc's defaults (MALLOC_ARENA_MAX=16 is its default for 2 cores) map the temporaries afresh
  # on every call: thousands of faults per call (about 37,000 on the 2-core test machine with
  # these 144 MB; about 69,000 with 256 MB: every page, with x 64 or 128 wide; with x 512 wide,
  # 2,500 there and 6,000-9,000 on the development machine).
  assert default_applied == "False"
  assert default > 2_000, default
  assert kept < 200, kept
  # Per-thread arenas (decode.py's choice) are applied too, but keep only blocks that fit an
  # arena's 64 MB heap: these 144 MB temporaries are mapped afresh on every call, as documented.
  assert thread_applied == "True" and per_thread > 2_000, per_thread


def test_the_environment_s_own_settings_win():
  assert host_memory.user_settings({"PATH": "/bin"}) == []
  assert host_memory.user_settings({"MALLOC_ARENA_MAX": "4"}) == ["MALLOC_ARENA_MAX"]
  assert host_memory.user_settings({"GLIBC_TUNABLES": "glibc.malloc.mmap_max=0"}) == [
    "GLIBC_TUNABLES"
  ]
  assert host_memory.user_settings({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX"}) == []
