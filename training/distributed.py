"""Joining a multi-process (multi-host) job: `jax.distributed.initialize` with clear errors.

    initialize_distributed(coordinator_address, num_processes, process_id, timeout_s)

With the three arguments given they are used and JAX's cluster detection is off, so every process
uses all of its local devices (under SLURM or Open MPI detection would pin each process to one GPU
by its local rank; set JAX_LOCAL_DEVICE_IDS to choose devices). Without them JAX reads the cluster
environment it detects (SLURM, Open MPI, Kubernetes, Cloud TPU); on a machine with none of them
this is a single-process run and nothing happens.

With the flags, processes other than 0 first check that the coordinator answers as a gRPC server
(an HTTP/2 handshake), within the same timeout: JAX itself, connected to a service that accepts
the connection and never answers (the wrong port, a hung coordinator), waits out its timeout and
then aborts the process with a C++ stack trace instead of raising.
"""

from __future__ import annotations

import socket
import time

import jax

from core.errors import RunError, UsageError

# What `jax.distributed.initialize()` raises, before it starts anything, when it was given no
# coordinator and detected no cluster environment, and when JAX has already computed in this
# process (then it is a single-process run whatever the environment: tests, notebooks).
_NO_CLUSTER = "coordinator_address should be defined"
_TOO_LATE = "must be called before"


def initialize_distributed(
  coordinator_address: str | None,
  num_processes: int | None,
  process_id: int | None,
  timeout_s: int = 300,
) -> None:
  """Joins the job, or returns at once for a single-process run. UsageError for flags that do
  not go together; RunError when the coordinator cannot be reached within `timeout_s`."""
  explicit = bool(coordinator_address) or (num_processes is not None and num_processes > 1)
  if not explicit:
    try:
      jax.distributed.initialize(initialization_timeout=timeout_s)
    except (ValueError, RuntimeError) as e:
      if _NO_CLUSTER in str(e) or _TOO_LATE in str(e):
        return  # one process
      raise RunError(f"could not start the distributed job JAX detected: {e}") from None
    except Exception as e:  # noqa: BLE001 - JAX's own errors joining a detected cluster
      raise RunError(
        f"could not join the distributed job JAX detected within {timeout_s} s: {e}"
      ) from None
    return
  if not coordinator_address or num_processes is None or process_id is None:
    raise UsageError(
      "--coordinator_address, --num_processes and --process_id must be given "
      f"together (got {coordinator_address!r}, {num_processes!r}, {process_id!r})"
    )
  if not 0 <= process_id < num_processes:
    raise UsageError(f"--process_id={process_id} must be in [0, --num_processes={num_processes})")
  host, port = _host_port(coordinator_address)
  if process_id != 0:
    # JAX aborts the whole process (no exception) when the coordinator never answers, so wait for
    # it here first and fail with a message instead.
    _wait_for_coordinator(host, port, timeout_s, f"process {process_id} of {num_processes}")
  try:
    jax.distributed.initialize(
      coordinator_address=coordinator_address,
      num_processes=num_processes,
      process_id=process_id,
      initialization_timeout=timeout_s,
      cluster_detection_method="deactivate",
    )
  except Exception as e:  # noqa: BLE001 - JAX's own errors joining
    raise RunError(
      f"could not join the distributed job at coordinator {coordinator_address!r} within "
      f"{timeout_s} s (process {process_id} of {num_processes}): {e}"
    ) from None


def _host_port(address: str) -> tuple[str, int]:
  host, _, port = address.rpartition(":")
  if not host or not port.isdigit():
    raise UsageError(f"--coordinator_address={address!r}: expected host:port")
  return host.strip("[]"), int(port)


# The HTTP/2 client connection preface and an empty SETTINGS frame (RFC 9113, 3.4 and 6.5): a
# gRPC server answers with its own SETTINGS frame, type 0x4 on stream 0.
_HTTP2_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_SETTINGS = 4


def _wait_for_coordinator(host: str, port: int, timeout_s: float, who: str) -> None:
  """Returns once `host:port` answers the HTTP/2 handshake as a gRPC server (JAX's coordinator is
  one); RunError after `timeout_s`: nothing listens there, or something that is not a
  coordinator (a service that accepts and never answers, or answers in another protocol)."""
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      connection = socket.create_connection((host, port), timeout=2)
    except OSError as e:
      problem = e.strerror or str(e)
    else:
      try:
        with connection:
          connection.settimeout(max(deadline - time.monotonic(), 0.1))
          connection.sendall(_HTTP2_HELLO)
          header = b""
          while len(header) < 9 and (chunk := connection.recv(9 - len(header))):
            header += chunk
        if len(header) == 9 and header[3] == _SETTINGS and not any(header[5:9]):
          return
        problem = "it answers, but not as a gRPC server (is that the coordinator's port?)"
      except TimeoutError:
        problem = "it accepted the connection but never answered (not a JAX coordinator?)"
      except OSError as e:
        problem = e.strerror or str(e)
    if time.monotonic() >= deadline:
      raise RunError(
        f"could not join the distributed job at coordinator {host}:{port} within "
        f"{timeout_s} s ({who}): {problem}"
      ) from None
    time.sleep(0.5)
