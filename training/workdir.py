"""The run's workdir: checked writable before any work, and locked by the run that writes in it.

check_workdir(workdir)                       # creates it; UsageError when it cannot be written
check_writable_folder(folder, "checkpoint folder")  # the same for a folder inside it
with WorkdirLock(workdir) as lock:           # process 0 of a run, for the whole run
  ...
  lock.check()                               # RunError once another run has forced it away

The lock is `<workdir>/lock`, a JSON file naming its holder: host, pid, the pid's start time (so
that a reused pid is not mistaken for the holder), the machine's boot id, when it was taken and the
command line. It is created with O_CREAT | O_EXCL, so of two runs starting together exactly one
gets it; the other is refused at once with a UsageError naming the holder. The file's modification
time is the holder's heartbeat, refreshed every HEARTBEAT_S seconds by a daemon thread.

A lock whose holder is dead is taken over with a warning. On the holder's host that is known for
certain: its pid is gone, a zombie, or another process (another start time or boot); so it is when
the holder was an earlier run of this SLURM job, requeued since (SLURM_JOB_ID, SLURM_RESTART_COUNT),
wherever it ran. From another host it is presumed when the heartbeat is older than STALE_AFTER_S
(four heartbeats; the hosts' clocks, or the file server's, must agree to well within that).
`take_over=True` (train.py --take_over_lock) takes the lock whatever its holder's state; that
holder then stops at its next heartbeat with an error instead of writing on. Takers take turns (an
O_EXCL file `<workdir>/lock.takeover`); in its turn a taker removes the lock only if it is still
the one it judged, and creates its own with O_EXCL: of two takers only one wins.

The lock is deleted when the run ends, also on errors and after a stop signal, and by
`release_held_locks()` when the process is ended at once (core/ending.py: a multi-process job
stops because another process was lost, cluster/distributed.py, or a stop signal went
unanswered); a process killed with SIGKILL leaves it behind, for the next run to take over.
Readers (decode.py, cli.average) ignore it; so do processes other than 0 of a multi-host job.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import shlex
import socket
import sys
import tempfile
import threading
import time
import uuid

from absl import logging

from core import ending
from core.errors import ArgumentError, RunError, UsageError

LOCK_NAME = "lock"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 4 * HEARTBEAT_S
TAKEOVER_TURN_S = 10.0  # a takeover's turn (see WorkdirLock._take_over) older than this is void
TAKE_OVER = "take_over_lock"  # training.loop.train's argument (train.py's flag of that name)


def check_workdir(workdir: pathlib.Path) -> None:
  """Creates `workdir` if needed and checks that this process can write in it."""
  check_writable_folder(workdir, "workdir")


def check_writable_folder(folder: pathlib.Path, name: str) -> None:
  """Creates `folder` if needed and checks that this process can write in it; UsageError naming
  it otherwise: an ArgumentError when `name` is the caller's argument (e.g. 'workdir'), else
  '<name> <folder>: ...' (e.g. 'checkpoint folder')."""
  folder = pathlib.Path(folder)
  try:
    if folder.exists() and not folder.is_dir():
      raise NotADirectoryError(0, "not a folder")
    folder.mkdir(parents=True, exist_ok=True)
    # A probe of its own per process: with one shared name, processes of a multi-host job raced
    # (one deleted the file another was about to delete: FileNotFoundError, seen in CI).
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".write_test-"):
      pass
  except OSError as e:
    problem = f"not writable ({e.strerror or e})"
    if name.isidentifier():
      raise ArgumentError(name, folder, problem) from None
    raise UsageError(f"{name} {folder}: {problem}") from None


# ----------------------------------------------------------------------------- the lock
def _proc_stat(pid: int) -> list[str] | None:
  """The fields of /proc/<pid>/stat after the command name (state first), or None where there
  is no such file (the pid is gone, or no /proc)."""
  try:
    return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
  except (OSError, IndexError):
    return None


def _pid_start(pid: int) -> str | None:
  """The pid's start time (clock ticks since boot, /proc/<pid>/stat field 22), or None."""
  fields = _proc_stat(pid)
  return fields[19] if fields and len(fields) > 19 else None


def _boot_id() -> str | None:
  try:
    return pathlib.Path("/proc/sys/kernel/random/boot_id").read_text().strip()
  except OSError:
    return None


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's process: it exists
    return True
  fields = _proc_stat(pid)
  return not (fields and fields[0] == "Z")  # a zombie has exited (its parent has not reaped it)


def _when(seconds: float) -> str:
  return datetime.datetime.fromtimestamp(seconds).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")


def describe_holder(record: dict, age_s: float) -> str:
  """'host h, pid 12, since <time> (heartbeat 3 s ago)' of a lock's record."""
  if not record:
    return f"a damaged lock file (last written {age_s:.0f} s ago)"
  since = record.get("since")
  return (
    f"host {record.get('host', '?')}, pid {record.get('pid', '?')}"
    + (f", since {_when(since)}" if isinstance(since, (int, float)) else "")
    + f" (heartbeat {age_s:.0f} s ago)"
  )


def _slurm_job() -> tuple[str | None, int]:
  """This process's SLURM job id (None outside SLURM) and how often SLURM has requeued it."""
  return os.environ.get("SLURM_JOB_ID"), int(os.environ.get("SLURM_RESTART_COUNT") or 0)


def why_dead(record: dict, age_s: float) -> str | None:
  """Why the lock's holder is known (same host, or an earlier run of this requeued SLURM job) or
  presumed (another host) dead; None while it may be alive."""
  if not record:  # empty: a holder between creating and writing it, or one killed just then
    return "its lock file is damaged" if age_s > STALE_AFTER_S else None
  job, restarts = _slurm_job()
  if job and record.get("slurm_job") == job and record.get("slurm_restart", 0) < restarts:
    return f"SLURM has requeued its job {job} since (it ended before this run was started)"
  if record.get("host") != socket.gethostname():
    if age_s > STALE_AFTER_S:
      return f"its heartbeat stopped {age_s:.0f} s ago (more than {STALE_AFTER_S:.0f} s)"
    return None
  pid, boot = record.get("pid"), _boot_id()
  if not isinstance(pid, int):
    return "its lock file names no pid"
  if record.get("boot_id") and boot and record["boot_id"] != boot:
    return "this host has restarted since"
  if not _pid_alive(pid):
    return f"pid {pid} is gone"
  start = _pid_start(pid)
  if record.get("pid_start") and start and start != record["pid_start"]:
    return f"pid {pid} is now another process"
  return None


_HELD: set[WorkdirLock] = set()  # this process's locks, for release_held_locks


def release_held_locks() -> None:
  """Releases every lock this process holds: what a process that must exit at once does first."""
  for lock in list(_HELD):
    lock.release()


class WorkdirLock:
  """`<workdir>/lock`, held from `acquire()` (or `with`) to `release()`; see the module's
  docstring."""

  def __init__(self, workdir: pathlib.Path, take_over: bool = False):
    self.path = pathlib.Path(workdir) / LOCK_NAME
    self.take_over = take_over
    self.lost: str | None = None  # set by the heartbeat once another run took the lock away
    self._token = uuid.uuid4().hex
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def _record(self) -> dict:
    pid = os.getpid()
    return {
      "host": socket.gethostname(),
      "pid": pid,
      "pid_start": _pid_start(pid),
      "boot_id": _boot_id(),
      "since": time.time(),
      "command": shlex.join(sys.argv),
      "slurm_job": _slurm_job()[0],
      "slurm_restart": _slurm_job()[1],
      "token": self._token,
      "heartbeat_s": HEARTBEAT_S,
    }

  def _read(self) -> tuple[bytes, dict, float, int] | None:
    """(content, record, heartbeat age in seconds, inode) of the lock file; None when there is
    none. A record that is not JSON reads as {}."""
    try:
      with open(self.path, "rb") as f:
        raw, st = f.read(), os.fstat(f.fileno())
    except FileNotFoundError:
      return None
    try:
      record = json.loads(raw)
    except ValueError:
      record = {}
    return raw, record if isinstance(record, dict) else {}, time.time() - st.st_mtime, st.st_ino

  def _create(self) -> bool:
    """Creates the lock file holding this run's record; False when one exists."""
    try:
      fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies
    except FileExistsError:
      return False
    try:
      with os.fdopen(fd, "w") as f:
        json.dump(self._record(), f, indent=1)
        f.write("\n")
    except BaseException:  # a full disk, say: leave no empty lock behind
      self.path.unlink(missing_ok=True)
      raise
    # A taker that judged an empty (just created) file damaged may have replaced it meanwhile.
    now = self._read()
    return now is not None and now[1].get("token") == self._token

  def _take_over(self, judged: tuple[bytes, dict, float, int]) -> bool:
    """Replaces the lock judged dead (or forced) by this run's; False when it changed meanwhile
    or another taker is at it. Takers take turns through `<lock>.takeover` (O_EXCL), so that a
    lock is removed only by one that has just seen it unchanged: of two takers one wins."""
    turn = self.path.with_name(f"{LOCK_NAME}.takeover")
    try:
      os.close(os.open(turn, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except FileExistsError:
      try:  # a taker dies there only between two system calls; one left behind is old
        if time.time() - turn.stat().st_mtime > TAKEOVER_TURN_S:
          turn.unlink()
      except FileNotFoundError:
        pass
      time.sleep(0.1)  # its turn: it ends within milliseconds
      return False
    try:
      now = self._read()
      if now is None or (now[0], now[3]) != (judged[0], judged[3]):
        return False
      self.path.unlink()
      return self._create()
    finally:
      turn.unlink(missing_ok=True)

  def _start_heartbeat(self) -> WorkdirLock:
    self._thread = threading.Thread(target=self._beat, name="workdir-lock", daemon=True)
    self._thread.start()
    _HELD.add(self)
    ending.on_end(release_held_locks)  # a process ended at once leaves no lock behind
    return self

  def acquire(self) -> WorkdirLock:
    """Takes the lock: creates it, takes over a dead holder's (a warning), or raises UsageError
    naming the live holder."""
    for _ in range(50):  # the lock may come and go between the steps; a few rounds settle it
      if self._create():
        return self._start_heartbeat()
      found = self._read()
      if found is None:
        continue  # released meanwhile
      dead = why_dead(found[1], found[2])
      holder = describe_holder(found[1], found[2])
      if dead is None and not self.take_over:
        raise ArgumentError(
          "workdir",
          self.path.parent,
          f"in use by another run: {holder}, lock {self.path}; wait for it, stop it, or use "
          f"another workdir ({TAKE_OVER} only if that run is dead)",
        )
      if self._take_over(found):
        logging.warning(
          "took over %s from %s: %s",
          self.path,
          holder,
          dead or f"forced by {TAKE_OVER} (make sure that run is stopped)",
        )
        return self._start_heartbeat()
    raise UsageError(f"{self.path}: could not take the lock (other runs keep taking it)")

  def _beat(self) -> None:
    while not self._stop.wait(HEARTBEAT_S) and self.refresh():
      pass

  def refresh(self) -> bool:
    """One heartbeat: touches the lock file if it is still this run's (True), else records in
    `lost` who took it (False)."""
    try:
      found = self._read()
      if found is None or found[1].get("token") != self._token:
        self.lost = "deleted" if found is None else f"taken by {describe_holder(*found[1:3])}"
        logging.error("%s: this run's lock was %s", self.path, self.lost)
        return False
      os.utime(self.path)
    except OSError as e:  # a passing file-system error: the next heartbeat tries again
      logging.warning("%s: heartbeat failed (%s)", self.path, e.strerror or e)
    return True

  def check(self) -> None:
    """RunError once another run has taken the lock (take_over_lock): two runs must not write
    in one workdir, so this one stops without a new checkpoint."""
    if self.lost:
      raise RunError(
        f"{self.path}: the workdir lock was {self.lost}; this run stops without saving, so that "
        "only one run writes in the workdir"
      )

  def release(self) -> None:
    """Stops the heartbeat and deletes the lock file if it is still this run's."""
    _HELD.discard(self)
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=5)
      self._thread = None
      found = self._read()
      if found is not None and found[1].get("token") == self._token:
        try:
          self.path.unlink()
        except FileNotFoundError:
          pass

  def __enter__(self) -> WorkdirLock:
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()
