"""Joining a multi-process (multi-host) job, and stopping every process when one is lost.

    initialize_distributed(coordinator_address, num_processes, process_id, timeout_s, heartbeat_s)
    ...                                  # training; the loop calls at_step(step) after each step
    stop_after_error(error)              # train.py, before it reports an error of this process
    finish()                             # train.py, once training ended well

With the three arguments given they are used and JAX's cluster detection is off, so every process
uses all of its local devices (under SLURM or Open MPI detection would pin each process to one GPU
by its local rank; set JAX_LOCAL_DEVICE_IDS to choose devices). Without them JAX reads the cluster
environment it detects (SLURM, Open MPI, Kubernetes, Cloud TPU); on a machine with none of them
this is a single-process run and nothing happens.

With the flags, processes other than 0 first check that the coordinator answers as a gRPC server
(an HTTP/2 handshake), within the same timeout: JAX itself, connected to a service that accepts
the connection and never answers (the wrong port, a hung coordinator), waits out its timeout and
then aborts the process with a C++ stack trace instead of raising.

A lost process. JAX's coordination service runs in a child of process 0 (cluster/coordinator.py),
so that it outlives process 0, in its recoverable mode, so that it makes no process abort. Every
process then runs a `JobWatch`: two daemon threads that write a heartbeat key into the service's
key-value store every second (at most `heartbeat_s` / 5) and read everyone's. A process whose
heartbeat has not changed for `heartbeat_s` seconds (killed, crashed, out of memory, frozen, its
host down), or that stopped on an error of its own (its `stop_after_error` wrote why), ends the
job: every other process ends at once through the command line's exit (core/ending.py: the
workdir lock released, one line naming the lost process (id, host, pid) and the step, exit status
1; neither the collective it may be stuck in nor JAX's shutdown barrier can hold it; called from
Python, the main thread gets a KeyboardInterrupt instead). The same when the service
itself cannot be reached for `heartbeat_s` (process 0's host is down). A collective that fails
because a peer is gone (Gloo's "Connection reset by peer") raises in the main thread first:
`stop_after_error` then waits for the watch to name the lost process instead of reporting it.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Sequence

import jax
from absl import logging

from cluster import coordinator, jax_private
from core import ending
from core.errors import FAILURE, ArgumentError, RunError, UsageError, message

# What `jax.distributed.initialize()` raises, before it starts anything, when it was given no
# coordinator and detected no cluster environment, and when JAX has already computed in this
# process (then it is a single-process run whatever the environment: tests, notebooks).
_NO_CLUSTER = "coordinator_address should be defined"
_TOO_LATE = "must be called before"

HEARTBEAT_S = 30  # the default of initialize_distributed's heartbeat_s


def _jax_heartbeat_s(heartbeat_s: int) -> int:
  """JAX's own heartbeat timeout: a client that cannot reach the service that long aborts the
  process (a C++ check failure), so it is longer than the watch's."""
  return 2 * heartbeat_s + 10


def initialize_distributed(
  coordinator_address: str | None,
  num_processes: int | None,
  process_id: int | None,
  timeout_s: int = 300,
  heartbeat_s: int = HEARTBEAT_S,
  service_command: Sequence[str] | None = None,
) -> None:
  """Joins the job and starts its `JobWatch`, or returns at once for a single-process run.
  UsageError for arguments that do not go together; RunError when the coordinator cannot be
  reached within `timeout_s`. `heartbeat_s`: how long a process may show no sign of life before
  the others stop. `service_command`: the program process 0 runs its coordination service in
  (cluster/coordinator.py; train.py's is cli/coordination_service.py); None: JAX's own, inside
  process 0, whose loss then aborts the others with a stack trace."""
  explicit = bool(coordinator_address) or (num_processes is not None and num_processes > 1)
  settings = dict(
    initialization_timeout=timeout_s, heartbeat_timeout_seconds=_jax_heartbeat_s(heartbeat_s)
  )
  own_service = coordinator.service_in_own_process(2 * heartbeat_s + 10, timeout_s, service_command)
  if not explicit:
    try:
      with own_service:
        jax.distributed.initialize(**settings)
    except (ValueError, RuntimeError) as e:
      if _NO_CLUSTER in str(e) or _TOO_LATE in str(e):
        return  # one process
      raise RunError(f"could not start the distributed job JAX detected: {e}") from None
    except Exception as e:  # noqa: BLE001 - JAX's own errors joining a detected cluster
      raise RunError(
        f"could not join the distributed job JAX detected within {timeout_s} s: {e}"
      ) from None
    _start_watch(heartbeat_s)
    return
  if not coordinator_address or num_processes is None or process_id is None:
    raise UsageError(
      "coordinator_address, num_processes and process_id must be given together (got "
      f"coordinator_address={coordinator_address!r}, num_processes={num_processes!r}, "
      f"process_id={process_id!r})"
    )
  if not 0 <= process_id < num_processes:
    raise ArgumentError("process_id", process_id, f"must be in [0, num_processes={num_processes})")
  host, port = _host_port(coordinator_address)
  if process_id != 0:
    # JAX aborts the whole process (no exception) when the coordinator never answers, so wait for
    # it here first and fail with a message instead.
    _wait_for_coordinator(host, port, timeout_s, f"process {process_id} of {num_processes}")
  try:
    with own_service:
      jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        cluster_detection_method="deactivate",
        **settings,
      )
  except RunError:
    raise
  except Exception as e:  # noqa: BLE001 - JAX's own errors joining
    raise RunError(
      f"could not join the distributed job at coordinator {coordinator_address!r} within "
      f"{timeout_s} s (process {process_id} of {num_processes}): {e}"
    ) from None
  _start_watch(heartbeat_s)


# ----------------------------------------------------------------------------- the watch
_KEY = "attention_jax"  # the key-value store's folder for the watch
_WATCH: JobWatch | None = None


def _start_watch(heartbeat_s: int) -> None:
  global _WATCH
  if jax.process_count() == 1:
    return
  if jax.process_index() == 0 and not coordinator.hosted_here():
    logging.warning(
      "JAX started its coordination service inside this process (this JAX differs from the one "
      "cluster/jax_private.py knows): if this process dies, the others abort with a stack trace"
    )
  _WATCH = JobWatch(
    jax_private.distributed_client(), jax.process_index(), jax.process_count(), heartbeat_s
  )


def at_step(step: int) -> None:
  """Records the step this process has reached, for the line naming a lost process."""
  if _WATCH is not None:
    _WATCH.step = step


def stop_after_error(error: BaseException) -> None:
  """Before this process reports `error` and exits: unless it is bad usage or input (the same on
  every process), waits up to the heartbeat timeout for the watch to find a lost process (whose
  loss may have caused it: a failed collective; then the watch ends this process with its line);
  then tells the others that this process stopped, and why."""
  watch = _WATCH
  if watch is None:
    return
  if not isinstance(error, UsageError):
    watch.wait_for_verdict()
  watch.close()
  watch.publish("stopped", message(error).splitlines()[0][:300] if str(error) else repr(error))


def finish() -> None:
  """After training ended well on this process: waits for every process to get there (the watch
  still judging), then leaves the job; process 0, whose child serves the job, leaves last."""
  global _WATCH
  watch, _WATCH = _WATCH, None
  if watch is None:
    return
  watch.publish("finished", "1")
  watch.wait_until_all_finished()
  watch.close()
  if watch.process_id == 0:
    watch.wait_until_others_left(timeout_s=10.0)
    coordinator.finished()
  jax.distributed.shutdown()


class JobWatch:
  """The heartbeat and the judge of one process (see the module's docstring)."""

  def __init__(self, client, process_id: int, num_processes: int, heartbeat_s: float):
    self.process_id, self.num_processes = process_id, num_processes
    self.step: int | None = None
    self._client, self._timeout = client, float(heartbeat_s)
    self._period = min(1.0, heartbeat_s / 5)
    self._lock = threading.Lock()
    self._closed = threading.Event()
    now = time.monotonic()
    self._last_contact = now
    self._beats: dict[int, tuple[str | None, float]] = {
      i: (None, now) for i in range(num_processes)
    }
    self._hosts: dict[int, str] = {}
    self._stopped: dict[int, str] = {}
    self._finished: set[int] = set()
    self.publish("host", f"host {socket.gethostname()}, pid {os.getpid()}")
    self._threads = [
      threading.Thread(target=self._beat, name="job-watch-beat", daemon=True),
      threading.Thread(target=self._judge, name="job-watch-judge", daemon=True),
    ]
    for thread in self._threads:
      thread.start()

  def publish(self, kind: str, value: str) -> None:
    """Writes `<kind>/<this process>` into the job's key-value store (best effort)."""
    try:
      self._client.key_value_set(f"{_KEY}/{kind}/{self.process_id}", value, allow_overwrite=True)
    except Exception as e:  # noqa: BLE001 - the service may be gone: the others notice that too
      logging.warning("could not tell the job's other processes %s: %s", kind, message(e))

  def _beat(self) -> None:
    count = 0
    while not self._closed.wait(self._period):
      count += 1
      try:
        self._client.key_value_set(
          f"{_KEY}/beat/{self.process_id}", str(count), allow_overwrite=True
        )
        entries = self._client.key_value_dir_get(f"{_KEY}/")
      except Exception:  # noqa: BLE001 - the service cannot be reached: the judge counts the time
        continue
      now = time.monotonic()
      with self._lock:
        self._last_contact = now
        for key, value in entries:
          kind, _, who = key.rstrip("/").rpartition("/")
          kind = kind.rpartition("/")[2]
          if not who.isdigit():
            continue
          who = int(who)
          if kind == "beat" and self._beats.get(who, (None,))[0] != value:
            self._beats[who] = (value, now)
          elif kind == "host":
            self._hosts[who] = value
          elif kind == "stopped":
            self._stopped[who] = value
          elif kind == "finished":
            self._finished.add(who)

  def _who(self, process: int) -> str:
    host = self._hosts.get(process)
    return f"process {process} of {self.num_processes}" + (f" ({host})" if host else "")

  def _at(self) -> str:
    return "before training started" if self.step is None else f"at step {self.step}"

  def verdict(self) -> str | None:
    """Why the job cannot go on, or None while every process is alive."""
    now = time.monotonic()
    resume = "re-run the same command on every process to resume from the newest checkpoint"
    with self._lock:
      for process, why in sorted(self._stopped.items()):
        if process != self.process_id:
          return (
            f"{self._who(process)} stopped on an error (its own line says: {why}); this process "
            f"stopped too, {self._at()}; fix that, then {resume}"
          )
      if now - self._last_contact > self._timeout:
        return (
          f"lost contact with the job's coordination service ({self._who(0)}, the coordinator's "
          f"address) for {self._timeout:.0f} s, {self._at()}: process 0's host is "
          f"down or unreachable; stopped; {resume}"
        )
      lost = [
        process
        for process, (_, since) in sorted(self._beats.items())
        if process != self.process_id
        and process not in self._finished
        and now - since > self._timeout
      ]
    if lost:
      return (
        f"{' and '.join(self._who(p) for p in lost)} lost {self._at()}: no sign of life for "
        f"{self._timeout:.0f} s (the heartbeat timeout; killed, crashed, out of memory, frozen or "
        f"its host down); stopped; {resume}"
      )
    return None

  def _judge(self) -> None:
    while not self._closed.wait(self._period):
      why = self.verdict()
      if why is not None and not self._closed.is_set():
        ending.end_process(FAILURE, why)
        return  # called from Python, the process goes on: the verdict is given once

  def wait_for_verdict(self) -> None:
    """Sleeps as long as a lost process takes to be noticed (the judge may end the process)."""
    time.sleep(self._timeout + 3 * self._period)

  def wait_until_all_finished(self) -> None:
    """Returns once every process has published `finished` (the judge ends this process if one
    is lost meanwhile)."""
    while True:
      with self._lock:
        if len(self._finished | {self.process_id}) == self.num_processes:
          return
      time.sleep(self._period / 2)

  def wait_until_others_left(self, timeout_s: float) -> None:
    """Process 0: returns once the other processes have left the job (JAX's list of live
    processes, which waits for every live one to ask too, holds this one only), or after
    `timeout_s`."""
    everyone = list(range(self.num_processes))
    asking = threading.Thread(
      target=lambda: self._client.get_live_nodes(everyone), name="job-left", daemon=True
    )
    asking.start()
    asking.join(timeout_s)

  def close(self) -> None:
    self._closed.set()
    for thread in self._threads:
      if thread is not threading.current_thread():
        thread.join(timeout=5)


# ----------------------------------------------------------------------------- joining
def _host_port(address: str) -> tuple[str, int]:
  host, _, port = address.rpartition(":")
  if not host or not port.isdigit():
    raise ArgumentError("coordinator_address", address, "expected host:port")
  return host.strip("[]"), int(port)


def _wait_for_coordinator(host: str, port: int, timeout_s: float, who: str) -> None:
  """Returns once `host:port` answers as a gRPC server (JAX's coordinator is one); RunError after
  `timeout_s`: nothing listens there, or something that is not a coordinator (a service that
  accepts and never answers, or answers in another protocol)."""
  deadline = time.monotonic() + timeout_s
  while (
    problem := coordinator.probe(host, port, max(deadline - time.monotonic(), 0.1))
  ) is not None:
    if time.monotonic() >= deadline:
      raise RunError(
        f"could not join the distributed job at coordinator {host}:{port} within "
        f"{timeout_s} s ({who}): {problem}"
      ) from None
    time.sleep(0.5)
