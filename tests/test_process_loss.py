"""A multi-process job that loses a process, as real train.py jobs on localhost: a process
killed (SIGKILL) or frozen (SIGSTOP) at a fixed step. Every other process exits with status 1 and
one line naming the lost one, having seen no sign of life for --heartbeat_timeout; the same
command then resumes from the newest finished checkpoint with the losses of the uninterrupted
steps. The victim faults itself right after its step (a wrapper of train.py), so that no later
step or checkpoint can slip in between the step and the fault."""

import json
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest

from tests.helpers import JOB_ARGS, REPO, cpu_env, free_port

pytestmark = pytest.mark.slow  # real command-line processes or trained workdirs

HEARTBEAT_S = 4
EVERY = 3  # checkpoint_every_steps: a fault at step 3k + 2 leaves 3k finished, 3k + 3 impossible
ARGS = [
  *(a for a in JOB_ARGS if not a.startswith("--config.num_train_steps=")),
  "--config.num_train_steps=10",
  f"--config.checkpoint_every_steps={EVERY}",
  f"--heartbeat_timeout={HEARTBEAT_S}",
]
# train.py whose process faults itself once it has finished step argv[1] (argv[2]: 'kill' for
# SIGKILL, 'freeze' for SIGSTOP), first writing "fault at step <n>" to stderr.
_FAULTY_TRAIN = """
import os, runpy, signal, sys
fault_step, kind = int(sys.argv.pop(1)), sys.argv.pop(1)
from cluster import distributed
real = distributed.at_step
def at_step(step):
  real(step)
  if step == fault_step:
    print(f"fault at step {step}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
distributed.at_step = at_step
sys.argv[0] = "train.py"
runpy.run_path("train.py", run_name="__main__")
"""
CEILING_S = HEARTBEAT_S + 90  # a loose ceiling: the survivors' exit after the fault


@dataclass(eq=False)  # hashable by identity
class Job:
  """One launch of a job's processes (started together), stderr of each in `<workdir>.<run>.<i>`."""

  workdir: object
  processes: int
  port: int
  run: int
  faults: dict = field(default_factory=dict)  # process -> (step, 'kill' or 'freeze')
  procs: list = field(default_factory=list)

  def start(self):
    for i in range(self.processes):
      head = ["-c", _FAULTY_TRAIN, *map(str, self.faults[i])] if i in self.faults else ["train.py"]
      with open(self.stderr_path(i), "w") as stderr:
        self.procs.append(
          subprocess.Popen(
            [
              sys.executable,
              *head,
              *ARGS,
              f"--workdir={self.workdir}",
              f"--coordinator_address=127.0.0.1:{self.port}",
              f"--num_processes={self.processes}",
              f"--process_id={i}",
            ],
            cwd=REPO,
            env=cpu_env(1),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
          )
        )
    return self

  def stderr_path(self, i):
    return f"{self.workdir}.{self.run}.{i}"

  def stderr(self, i) -> str:
    with open(self.stderr_path(i)) as f:
      return f.read()

  def kill_all(self):
    for p in self.procs:
      p.kill()
      p.wait()


def _faulted(jobs, timeout=300) -> dict:
  """Waits for the fault of each job's victim (its line "fault at step <n>"); returns {job: when
  it was seen (time.monotonic())}, the fault having come just before."""
  when, deadline = {}, time.monotonic() + timeout
  while len(when) < len(jobs):
    for job in jobs:
      (victim,) = job.faults
      if job in when:
        continue
      if "fault at step" in job.stderr(victim):
        when[job] = time.monotonic()
      elif job.procs[victim].poll() is not None or time.monotonic() > deadline:
        for j in jobs:
          j.kill_all()
        raise AssertionError(f"no fault in process {victim}: {job.stderr(victim)[-3000:]}")
    time.sleep(0.05)
  return when


def _expect_stopped(faulted) -> None:
  """`faulted`: (job, victim, kind, when the fault came) each. Every process but the victim exits
  with status 1 (not a C++ abort, nor never), within the loose CEILING_S of the fault, its
  last line naming the victim (id, host, pid), its step, the heartbeat timeout it waited out and
  what to do; no other error line, no stack trace. Then the victims are killed."""
  exited = {}
  deadline = max(when for *_, when in faulted) + CEILING_S
  try:
    while time.monotonic() < deadline:
      for job, victim, _, _ in faulted:
        for i, p in enumerate(job.procs):
          if i != victim and (job, i) not in exited and p.poll() is not None:
            exited[job, i] = time.monotonic()
      if len(exited) == sum(job.processes - 1 for job, *_ in faulted):
        break
      time.sleep(0.05)
  finally:
    for job, *_ in faulted:
      job.kill_all()
  for job, victim, kind, _ in faulted:
    who = (
      rf"process {victim} of {job.processes} \(host {re.escape(socket.gethostname())}, pid "
      rf"{job.procs[victim].pid}\)"
    )
    for i in range(job.processes):
      if i == victim:
        continue
      err = job.stderr(i)
      assert (job, i) in exited, f"process {i} still running {CEILING_S} s after the fault"
      assert job.procs[i].returncode == 1, err[-3000:]
      assert re.fullmatch(
        rf"train\.py: error: {who} lost at step \d+: no sign of life for {HEARTBEAT_S} s "
        r"\(the heartbeat timeout; .*\); stopped; re-run the same command on every process to "
        r"resume from the newest checkpoint",
        err.splitlines()[-1],
      ), (kind, err[-3000:])
      assert err.count("error:") == 1 and "Check failed" not in err, err[-3000:]
      assert "stack trace" not in err, err[-3000:]


def _checkpoints(workdir) -> list[int]:
  """The finished checkpoints' steps (a save cut short leaves a temporary folder, never read)."""
  return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def _train_runs(workdir) -> list[dict]:
  """Process 0's train losses, {step: loss}, of each run in turn (a run starts where the steps
  go back)."""
  runs, last = [], None
  for line in (workdir / "metrics.jsonl").read_text().splitlines():
    record = json.loads(line)
    if record["split"] != "train":
      continue
    if last is None or record["step"] <= last:
      runs.append({})
    runs[-1][record["step"]] = record["loss"]
    last = record["step"]
  return runs


def test_lost_processes_stop_the_others_and_the_same_command_resumes(tmp_path):
  """One 2-process job run three times with the same command: its worker killed at step 5, then
  process 0 (the coordinator's host and the lock's holder) killed at step 8, then left to finish.
  Each time the other process stops as `_expect_stopped` says, the lock is released (left behind,
  and taken over by the next run, when process 0 was killed) and the newest finished checkpoint is
  intact; each relaunch resumes from it and logs the previous run's losses for the steps both ran,
  bit for bit. Alongside the first run, a 3-process job whose process 1 freezes at step 5:
  processes 0 and 2 both stop so, and release the lock."""
  workdir = tmp_path / "job"
  three = Job(tmp_path / "three", 3, free_port(), 0, {1: (5, "freeze")}).start()
  port = free_port()
  faults = [(1, 5, "kill"), (0, 8, "kill"), None]
  for run, fault in enumerate(faults):
    job = Job(workdir, 2, port, run, {fault[0]: fault[1:]} if fault else {}).start()
    if fault is None:
      for i, p in enumerate(job.procs):
        assert p.wait(timeout=300) == 0, job.stderr(i)[-3000:]
    else:
      victim, step, kind = fault
      also = [(three, 1, "freeze")] if run == 0 else []
      when = _faulted([job] + [j for j, *_ in also])
      _expect_stopped([(job, victim, kind, when[job]), *((j, v, k, when[j]) for j, v, k in also)])
      if also:
        assert not (three.workdir / "lock").exists()
        assert _checkpoints(three.workdir)[-1] == 3
      assert (workdir / "lock").exists() == (victim == 0)
      assert _checkpoints(workdir)[-1] == step - 2
    if run:
      err = job.stderr(0)
      assert f"resumed from {workdir / 'checkpoints' / str(faults[run - 1][1] - 2)}" in err, err
      assert ("took over" in err) == (faults[run - 1][0] == 0), err
  runs = _train_runs(workdir)
  assert [min(r) for r in runs] == [1, 4, 7] and max(runs[-1]) == 10
  for before, after in zip(runs, runs[1:]):
    both = before.keys() & after.keys()
    assert both and all(before[s] == after[s] for s in both), (before, after)
