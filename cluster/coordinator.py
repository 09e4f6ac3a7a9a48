"""JAX's coordination service in a process of its own, which process 0 of a job starts.

    with service_in_own_process(linger_s, timeout_s, command):  # around jax.distributed.initialize
      jax.distributed.initialize(...)                          # on process 0
    ...
    finished()                           # the job ended well: the service may stop at once

Every process of a job is a client of one coordination service (the key-value store, barriers,
heartbeats). JAX runs it inside process 0, so when process 0 dies (SIGKILL, a node failure) the
other processes' clients find their service gone and abort at once with a C++ check failure
(exit status 134, a stack trace) before Python can say anything. Run here in a small child
process instead (`serve`, which imports jaxlib alone), it outlives process 0: the others see
process 0's heartbeat stop (cluster/distributed.py's `JobWatch`) and exit with one line. The child
runs `command` (the command line's: cli/coordination_service.py, which calls `serve` and owns
how the child ends).

The service is started in "recoverable" mode (JAX's `jax_enable_recoverability`): the death of a
task is recorded, not propagated, so no client is made to abort by it either; the job's own
watch decides what to do. The child:

- stops the service and exits at once when the job ended well (`finished()`, then JAX's
  shutdown: process 0 writes "done" to the child's stdin);
- otherwise (process 0 died, or exited on an error) keeps serving while any client is still
  connected (the survivors, until they have noticed and exited), at most `linger_s`;
- ignores SIGINT and SIGTERM, which process 0 answers by saving and finishing (above).
"""

from __future__ import annotations

import os
import pathlib
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

from absl import logging

from cluster import jax_private
from core.errors import RunError

_READY = "ready"
_DONE = "done"
_START_TIMEOUT_S = 60


class CoordinatorProcess:
  """The child serving the coordination service; `shutdown()` is what JAX calls at exit (in
  place of the in-process service's)."""

  def __init__(
    self,
    command: Sequence[str],
    bind_address: str,
    num_processes: int,
    heartbeat_s: int,
    linger_s: float,
  ):
    self.finished = False
    self._child = subprocess.Popen(
      [
        *command,
        bind_address,
        str(num_processes),
        str(heartbeat_s),
        str(linger_s),
      ],
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      stderr=subprocess.DEVNULL,  # the service's own INFO and WARNING lines
      text=True,
      start_new_session=True,  # a Ctrl-C of the terminal goes to process 0, which finishes the job
    )
    ready, _, _ = select.select([self._child.stdout], [], [], _START_TIMEOUT_S)
    answer = (
      self._child.stdout.readline().strip() if ready else f"no answer in {_START_TIMEOUT_S} s"
    )
    if answer != _READY:
      self._child.kill()
      raise RunError(
        f"could not start the coordination service on {bind_address}: "
        + (answer or f"its process ended with status {self._child.wait()}")
      )

  def shutdown(self) -> None:
    """Tells the child the job ended well (it stops at once) or not (it waits for the others)."""
    try:
      if self.finished:
        self._child.stdin.write(_DONE + "\n")
      self._child.stdin.close()
    except OSError:
      pass
    if self.finished:
      try:
        self._child.wait(timeout=10)
      except subprocess.TimeoutExpired:
        self._child.kill()


_PROCESS: CoordinatorProcess | None = None


class service_in_own_process:  # noqa: N801 - used as a context manager, like a function
  """While in the block, JAX's factory of the coordination service (which
  `jax.distributed.initialize` calls on process 0) starts a `CoordinatorProcess` running
  `command` + its four arguments instead (None: JAX's own service, in this process).
  `linger_s`: how long the child serves after process 0 ended badly; `timeout_s`: how long to
  wait for the port while another coordinator (an earlier job's, still ending) answers on it."""

  def __init__(self, linger_s: float, timeout_s: float, command: Sequence[str] | None):
    self.linger_s, self.timeout_s, self.command = linger_s, timeout_s, command

  def __enter__(self):
    if self.command is None:
      return self
    _jax = jax_private.service_factory()
    self._module, self._real = _jax, _jax.get_distributed_runtime_service

    def start(address, num_nodes, heartbeat_timeout=None, shutdown_timeout=None, **_):
      global _PROCESS
      del shutdown_timeout  # the service is recoverable: no shutdown barrier
      # gRPC binds with SO_REUSEPORT: a second service on the port would share its connections.
      wait_until_free(int(address.rsplit(":", 1)[1]), self.timeout_s)
      _PROCESS = CoordinatorProcess(
        self.command, address, num_nodes, heartbeat_timeout or 100, self.linger_s
      )
      return _PROCESS

    _jax.get_distributed_runtime_service = start
    return self

  def __exit__(self, *exc):
    if self.command is not None:
      self._module.get_distributed_runtime_service = self._real


def finished() -> None:
  """Marks the job as ended well: at JAX's shutdown the service stops at once. Call once every
  other process has disconnected (cluster/distributed.py's `finish`)."""
  if _PROCESS is not None:
    _PROCESS.finished = True


def hosted_here() -> bool:
  return _PROCESS is not None


# ----------------------------------------------------------------------------- probing a port
# The HTTP/2 client connection preface and an empty SETTINGS frame (RFC 9113, 3.4 and 6.5): a
# gRPC server answers with its own SETTINGS frame, type 0x4 on stream 0.
_HTTP2_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_SETTINGS = 4


def probe(host: str, port: int, timeout_s: float) -> str | None:
  """None when `host:port` answers the HTTP/2 handshake as a gRPC server (JAX's coordinator is
  one) within `timeout_s`; else what went wrong."""
  try:
    connection = socket.create_connection((host, port), timeout=min(2.0, timeout_s))
  except OSError as e:
    return e.strerror or str(e)
  try:
    with connection:
      connection.settimeout(max(timeout_s, 0.1))
      connection.sendall(_HTTP2_HELLO)
      header = b""
      while len(header) < 9 and (chunk := connection.recv(9 - len(header))):
        header += chunk
    if len(header) == 9 and header[3] == _SETTINGS and not any(header[5:9]):
      return None
    return "it answers, but not as a gRPC server (is that the coordinator's port?)"
  except TimeoutError:
    return "it accepted the connection but never answered (not a JAX coordinator?)"
  except OSError as e:
    return e.strerror or str(e)


def wait_until_free(port: int, timeout_s: float) -> None:
  """Returns once no coordinator answers on this host's `port`; RunError after `timeout_s`."""
  deadline = time.monotonic() + timeout_s
  waiting = False
  while probe("127.0.0.1", port, 2.0) is None:
    if not waiting:
      waiting = True
      logging.warning(
        "port %d already answers as a coordinator (an earlier job's, still ending?): waiting up "
        "to %.0f s for it to stop",
        port,
        timeout_s,
      )
    if time.monotonic() >= deadline:
      raise RunError(
        f"port {port} of this host is in use by another coordinator for more than {timeout_s:.0f}"
        " s (another job, or an earlier one still ending); stop it or use another port"
      )
    time.sleep(0.5)


# ----------------------------------------------------------------------------- the child
def _client_connections(port: int) -> int | None:
  """Established TCP connections of this process on local `port` (the clients still connected);
  None where /proc cannot tell."""
  try:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
      try:
        target = os.readlink(f"/proc/self/fd/{fd}")
      except OSError:
        continue
      if target.startswith("socket:["):
        inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
      if not os.path.exists(table):
        continue
      for line in pathlib.Path(table).read_text().splitlines()[1:]:
        fields = line.split()
        local, state, inode = fields[1], fields[3], fields[9]
        if state == "01" and int(local.rsplit(":", 1)[1], 16) == port and inode in inodes:
          count += 1
    return count
  except (OSError, ValueError, IndexError):
    return None


def serve(args: Sequence[str]) -> object | None:
  """The child's program: `args` = bind address, process count, heartbeat timeout (s), linger
  (s). Serves until process 0 says the job ended well (then stops the service and returns None)
  or, when process 0 is gone or ended on an error, until the other clients have left or `linger`
  has passed: then it returns the service still running, and the caller must end the process
  without Python's shutdown, whose stop of the service would wait for the clients that are gone."""
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, signal.SIG_IGN)
  address, num_processes, heartbeat_s, linger_s = args[:4]
  try:
    service = jax_private.child_service_factory()(
      address, int(num_processes), heartbeat_timeout=int(heartbeat_s), recoverable=True
    )
  except Exception as e:  # noqa: BLE001 - reported to process 0, which raises it
    print(f"{type(e).__name__}: {e}".splitlines()[0], flush=True)
    return None
  print(_READY, flush=True)
  if sys.stdin.readline().strip() == _DONE:
    service.shutdown()
    return None
  port = int(address.rsplit(":", 1)[1])
  deadline = time.monotonic() + float(linger_s)
  time.sleep(1.0)
  while time.monotonic() < deadline and _client_connections(port) != 0:
    time.sleep(0.5)
  return service
