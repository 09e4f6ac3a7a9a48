"""Every private name of JAX this project uses, in one place, each with the public API that is
missing. pyproject.toml bounds jax to the minor versions tested (`jax>=0.10.2,<0.11`), and
tests/test_cluster.py checks that each name below still exists, so that a JAX upgrade that moves
one fails there in one line naming it, not silently (no process-loss detection) or at import.

- `distributed_client()`: the client of the job's coordination service, which
  `jax.distributed.initialize` made: its key-value store carries the heartbeats
  (cluster/distributed.py). Missing: a public accessor of the client
  (`jax.distributed` exposes `initialize`, `shutdown` and `is_initialized` only).
- `service_factory()`: the module holding `get_distributed_runtime_service`, the factory
  `jax.distributed.initialize` calls on process 0 to start the service in-process; replaced
  for the call to start it in a child process instead (cluster/coordinator.py). Missing: a
  public way to start the service elsewhere, or to join one already running.
- `child_service_factory()`: the same factory from jaxlib alone (no backend, no devices), which
  the child process calls with `recoverable=True` (the death of a client recorded, not made fatal
  to the others). Missing: a public constructor of the service.
"""

from __future__ import annotations

from cluster import private_names

# (module, attribute path): the private names used below.
NAMES = (
  ("jax._src.distributed", "global_state.client"),
  ("jax._src.lib", "_jax.get_distributed_runtime_service"),
  ("jaxlib._jax", "get_distributed_runtime_service"),
)


def missing() -> list[str]:
  """'module.attribute' of each name of NAMES this JAX does not have."""
  return private_names.missing(NAMES)


def distributed_client():
  """The coordination service's client of this process (after `jax.distributed.initialize`)."""
  from jax._src import distributed

  return distributed.global_state.client


def service_factory():
  """The module whose `get_distributed_runtime_service` `jax.distributed.initialize` calls on
  process 0 (assign the attribute to replace it)."""
  from jax._src.lib import _jax

  return _jax


def child_service_factory():
  """jaxlib's `get_distributed_runtime_service(address, num_nodes, heartbeat_timeout=...,
  recoverable=...)`, importing jaxlib alone."""
  from jaxlib import _jax

  return _jax.get_distributed_runtime_service
