"""Keeps freed host memory in the process, so XLA:CPU does not page-fault its buffers every step.

XLA:CPU allocates each execution's temporaries with `malloc` from its worker threads, a large
block per step. glibc serves a block that large to a worker thread with a fresh `mmap` whatever
its `M_MMAP_THRESHOLD`, and returns it with `munmap` when freed, so every step the kernel maps,
zeroes and page-faults those pages again. `keep_freed_memory()` makes glibc serve every thread
from the main heap (`M_ARENA_MAX` 1), never `mmap` (`M_MMAP_MAX` 0) and keep up to 2 GiB of
freed memory (`M_TRIM_THRESHOLD`), so the same pages are reused step after step; the numbers
computed do not change. What it saves is measured in docs/experiments.md, "Host memory".

The cost: the process keeps its peak host memory until it exits, as jemalloc or tcmalloc would.
train.py, decode.py and bench.py call `keep_freed_memory_on_cpu()` first thing, in an
`if __name__ == "__main__":` block above their other imports, before JAX exists, so the backend
is foreseen rather than asked: the settings apply when JAX will compute on the CPU
(`JAX_PLATFORMS` starts with `cpu`, or no accelerator plugin or libtpu is installed); on a GPU or
TPU host the temporaries live in device memory and glibc keeps its defaults.
Nothing is done off glibc, nor when the environment already sets any `MALLOC_*` variable or a
`glibc.malloc` tunable (your settings win; e.g. `MALLOC_ARENA_MAX=8` restores glibc's per-thread
arenas).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os

# mallopt parameters (glibc <malloc.h>).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1))


def user_settings(environ=os.environ) -> list[str]:
  """The environment's own malloc settings (names), which `keep_freed_memory` leaves alone."""
  names = [k for k in environ if k.startswith("MALLOC_")]
  if "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
    names.append("GLIBC_TUNABLES")
  return names


# What `keep_freed_memory_on_cpu` did, as bench.py reports it (`host_memory`).
KEPT = "kept"
DEFAULT = "process default"


def expects_cpu_backend(environ=os.environ) -> bool:
  """Whether JAX, once imported, will compute on the CPU: `JAX_PLATFORMS` decides when set;
  otherwise JAX takes an accelerator when one is installed: a PJRT plugin (jax[cuda], jax[rocm]),
  found as JAX finds them (the `jax_plugins` namespace package or entry-point group), or libtpu."""
  platforms = environ.get("JAX_PLATFORMS", "").strip().lower()
  if platforms:
    return platforms.split(",")[0].strip() == "cpu"
  if importlib.metadata.entry_points(group="jax_plugins"):
    return False
  return not any(importlib.util.find_spec(name) for name in ("jax_plugins", "libtpu"))


def keep_freed_memory_on_cpu(environ=os.environ, single_arena: bool = True) -> str:
  """`keep_freed_memory()` when JAX will run on the CPU; returns KEPT when the settings were
  applied, else DEFAULT (an accelerator backend, the environment's own malloc settings, or not
  glibc)."""
  if expects_cpu_backend(environ) and keep_freed_memory(environ, single_arena):
    return KEPT
  return DEFAULT


def keep_freed_memory(environ=os.environ, single_arena: bool = True) -> bool:
  """Applies the settings above through glibc's `mallopt`; call before JAX starts its threads
  (an existing thread keeps the arena it has). True when applied; False off glibc or when the
  environment has its own malloc settings.

  `single_arena=False` leaves glibc its per-thread arenas and sets only `M_MMAP_MAX` and
  `M_TRIM_THRESHOLD`: small allocations from several threads (XLA compiling programs in
  parallel) do not queue on one arena's lock, and a worker thread's block is kept when it fits
  its arena's heap (64 MB); a larger one is still mapped afresh each time. decode.py uses it
  (it compiles in parallel); training keeps the single arena (the trade-off measured in
  docs/experiments.md, "Host memory")."""
  if user_settings(environ):
    return False
  try:
    libc = ctypes.CDLL(None)  # the process's own symbols: its C library's among them
    mallopt = libc.mallopt
    _ = libc.gnu_get_libc_version  # glibc only: musl and macOS have no such function
  except (OSError, AttributeError, TypeError):
    return False
  mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
  ok = True
  for param, value in SETTINGS if single_arena else SETTINGS[1:]:
    ok = bool(mallopt(param, value)) and ok
  return ok
