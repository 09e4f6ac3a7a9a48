"""Faults of a shared cluster, injected into real train.py runs: SIGKILL at random moments (one
during an asynchronous save) and resume; a save that fails at the file layer; two runs on one
workdir; stale and forced workdir locks (training/workdir.py)."""

import json
import os
import random
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest

from core.errors import RunError, UsageError
from inference.restore import load_for_inference
from tests.helpers import REPO, assert_trees_equal, run_in_process, saved_params, train_losses
from training import checkpoint as ckpt
from training import workdir as wd
from training.average import write_average

pytestmark = pytest.mark.slow  # real command-line processes or trained workdirs

# The smallest model and batches of the multi-process jobs (tests/helpers.py JOB_ARGS) and one
# evaluation batch: the faults, locks and resumes checked here do not depend on the model's size,
# and each of the file's nine train.py runs compiles and steps faster (about 4 s of CPU each).
ARGS = [
  "--config=configs/tiny.py",
  "--config.model.num_layers=1",
  "--config.model.d_model=32",
  "--config.model.d_ff=64",
  "--config.data.tokens_per_batch=256",
  "--config.data.max_len=16",
  "--config.data.synthetic_max_len=6",
  "--config.data.synthetic_num_train=2000",  # 30 steps read about 1,100
  "--config.eval.num_batches=1",
  "--config.eval.bleu_sentences=0",
  "--config.num_devices=1",
  "--config.log_every_steps=1",
  "--config.checkpoint_every_steps=5",
  "--config.checkpoint.async_save=true",
]


def _start(workdir, *args, program=None, env=None):
  """train.py (or `program`, Python source run with train.py's flags) in a subprocess."""
  head = [sys.executable, "-c", program] if program else [sys.executable, str(REPO / "train.py")]
  return subprocess.Popen(
    [*head, *ARGS, f"--workdir={workdir}", *args],
    cwd=REPO,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )


def _steps_logged(metrics, offset: int) -> list[int]:
  """Steps of the train records appended to `metrics` after byte `offset`."""
  try:
    with open(metrics, "rb") as f:
      f.seek(offset)
      lines = f.read().decode().splitlines()
  except FileNotFoundError:
    return []
  return [json.loads(line)["step"] for line in lines[:-1] if '"split": "train"' in line]


def _wait(proc, condition, what, timeout=240):
  deadline = time.time() + timeout
  while not condition():
    if proc.poll() is not None:
      raise AssertionError(f"train.py ended before {what}: {proc.communicate()[1][-3000:]}")
    if time.time() > deadline:
      proc.kill()
      raise AssertionError(f"no {what} within {timeout} s")
    time.sleep(0.005)


def _unfinished_saves(workdir) -> list[str]:
  root = ckpt.checkpoint_dir(workdir)
  return (
    [p.name for p in root.iterdir() if ".orbax-checkpoint-tmp" in p.name] if root.is_dir() else []
  )


def _live_holder(workdir):
  """A lock naming this (live) test process as its holder."""
  lock = wd.WorkdirLock(workdir)
  (workdir / wd.LOCK_NAME).write_text(json.dumps(lock._record()))


STEPS = 30  # of the reference run and the run killed and resumed


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """An uninterrupted train.py run of STEPS steps (a checkpoint every 5), started in the background
  when first asked for; returns finished() -> its workdir, once it has exited 0. Tests copy the
  workdir before changing anything in it."""
  work = tmp_path_factory.mktemp("reference")
  proc = _start(work, f"--config.num_train_steps={STEPS}")

  def finished():
    assert proc.wait(timeout=300) == 0, proc.communicate()[1][-3000:]
    return work

  yield finished
  if proc.poll() is None:
    proc.kill()
    proc.wait()


def test_sigkill_at_random_moments_then_resume_equals_an_uninterrupted_run(tmp_path, reference):
  """Three SIGKILLs at seeded random steps, the second while an asynchronous save is in flight
  (Orbax's `<step>.orbax-checkpoint-tmp` folder exists, and is still there after the kill), each
  followed by a resume: every train loss (the last record of each step: a resume replays the
  steps after its checkpoint) and the final parameters equal an uninterrupted run's. Each resume
  takes over the killed run's lock with a warning; the last one is given a live holder's lock and
  --take_over_lock."""
  steps = STEPS
  kills = sorted(random.Random(29).sample(range(4, steps - 6), 3))
  work = tmp_path / "killed"
  metrics = work / "metrics.jsonl"
  killed_pids, stderr = [], []
  for n, target in enumerate(kills):
    offset = metrics.stat().st_size if metrics.exists() else 0
    proc = _start(work, f"--config.num_train_steps={steps}")
    if n == 1:  # during a save of a step at or after the target
      _wait(
        proc,
        lambda: any(int(name.split(".")[0]) >= target for name in _unfinished_saves(work)),
        f"a save at step >= {target}",
      )
    else:
      _wait(
        proc, lambda: max(_steps_logged(metrics, offset), default=0) >= target, f"step {target}"
      )
    proc.send_signal(signal.SIGKILL)
    stderr.append(proc.communicate()[1])
    killed_pids.append(proc.pid)
    if n == 1:
      assert _unfinished_saves(work), "the kill came after the save had finished"
  _live_holder(work)
  final = _start(work, f"--config.num_train_steps={steps}", "--take_over_lock")
  out, err = final.communicate(timeout=300)
  assert final.returncode == 0, err[-3000:]
  uninterrupted = reference()

  for n in (1, 2):  # each resume took over the lock its killed predecessor left
    assert f"pid {killed_pids[n - 1]} is gone" in stderr[n], stderr[n][-3000:]
  assert f"pid {os.getpid()}" in err and "forced by take_over_lock" in err, err[-3000:]
  assert not (work / wd.LOCK_NAME).exists()
  ours, theirs = train_losses(work), train_losses(uninterrupted)
  assert sorted(ours) == list(range(1, steps + 1))
  assert ours == theirs
  assert_trees_equal(saved_params(work, steps), saved_params(uninterrupted, steps))


# train.py whose file layer fails: the FAIL_SAVE-th step folder Orbax creates raises ENOSPC.
_FULL_DISK = """
import errno, os, re, runpy, sys, time
real_makedirs, count = os.makedirs, 0
def makedirs(name, *args, **kwargs):
  global count
  if re.fullmatch(r"\\d+\\.orbax-checkpoint-tmp.*", os.path.basename(str(name))):
    count += 1
    if count == int(os.environ["FAIL_SAVE"]):
      print(f"injected at {time.time()}", file=sys.stderr, flush=True)
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(name))
  return real_makedirs(name, *args, **kwargs)
os.makedirs = makedirs
sys.argv = ["train.py"] + sys.argv[1:]
runpy.run_path("train.py", run_name="__main__")
"""


@pytest.mark.parametrize(
  "steps,fail_save,failed,last", [(20, 2, 10, 5), (12, 3, 12, 10)], ids=["during", "at_the_end"]
)
def test_a_save_that_fails_is_one_error_and_a_prompt_exit(tmp_path, steps, fail_save, failed, last):
  """The disk fills up under an asynchronous save: os.makedirs, which Orbax (through etils.epath)
  calls to create the step's temporary folder, is patched in the train.py process so that the
  FAIL_SAVE-th call raises OSError(ENOSPC). During training (the 2nd of the saves every 5 steps)
  and at the end (the final save of step 12): one line naming the step's folder and the system's
  reason, exit status 1 within seconds (not after Orbax's 300 s coordination timeout, nor with
  Orbax's tracebacks), the lock released and the last finished checkpoint restorable."""
  proc = _start(
    tmp_path,
    f"--config.num_train_steps={steps}",
    program=_FULL_DISK,
    env=dict(os.environ, FAIL_SAVE=str(fail_save)),
  )
  out, err = proc.communicate(timeout=300)
  ended = time.time()
  assert proc.returncode == 1, err[-3000:]
  injected = float(err.split("injected at ")[1].split()[0])
  assert ended - injected < 20, ended - injected
  error = err.strip().splitlines()[-1]
  assert error.startswith("train.py: error: could not save checkpoint "), err[-3000:]
  assert f"{tmp_path / 'checkpoints' / str(failed)} (No space left on device" in error
  assert err.count("train.py: error") == 1 and "Traceback" not in err, err[-3000:]
  assert not [line for line in err.splitlines() if line.startswith("E")], err[-3000:]
  assert f"the last finished checkpoint, {tmp_path / 'checkpoints' / str(last)}, is intact" in error
  assert ckpt.available_steps(tmp_path) == list(range(5, last + 1, 5))
  _, meta = ckpt.restore(ckpt.checkpoint_dir(tmp_path) / str(last))
  assert meta["step"] == last
  assert not (tmp_path / wd.LOCK_NAME).exists()


def test_a_second_run_on_a_workdir_is_refused_and_the_first_unharmed(tmp_path):
  """The same command started twice (a requeued job whose first instance still runs): the second
  (train.py's command line run in this process: the refusal comes before any work) is refused at
  once, exit status 2, one line naming the holder; the first goes on and, stopped by SIGTERM,
  saves and exits 0 with each step in metrics.jsonl once."""
  first = _start(tmp_path, "--config.num_train_steps=100000")
  metrics = tmp_path / "metrics.jsonl"
  _wait(first, lambda: _steps_logged(metrics, 0), "the first step")
  t0 = time.time()
  second = run_in_process(
    "train.py", *ARGS, f"--workdir={tmp_path}", "--config.num_train_steps=100000"
  )
  err = second.stderr
  refused_after = time.time() - t0
  first.send_signal(signal.SIGTERM)
  _, first_err = first.communicate(timeout=120)
  assert second.returncode == 2, err[-3000:]
  assert err.count("\n") == 1 and err.startswith("train.py: error: "), err
  assert (
    f"--workdir={tmp_path}: in use by another run: host {socket.gethostname()}, pid {first.pid}, "
    "since " in err
  )
  assert "take_over_lock only if that run is dead" in err
  assert refused_after < 60, refused_after
  assert first.returncode == 0, first_err[-3000:]
  steps = list(train_losses(tmp_path))
  records = metrics.read_text().splitlines()
  assert len(records) == len(steps) and steps == list(range(1, len(steps) + 1)), records
  assert ckpt.available_steps(tmp_path)[-1] == steps[-1]
  assert not (tmp_path / wd.LOCK_NAME).exists()


# ----------------------------------------------------------------------------- the lock itself
def _write_lock(workdir, age_s=0.0, **record):
  path = workdir / wd.LOCK_NAME
  path.write_text(json.dumps({"since": time.time() - age_s, "token": "old", **record}))
  os.utime(path, (time.time() - age_s, time.time() - age_s))
  return path


def _dead_pid() -> int:
  proc = subprocess.Popen([sys.executable, "-c", ""])
  proc.wait()
  return proc.pid


def test_a_dead_holders_lock_is_taken_over_with_a_warning(tmp_path, monkeypatch, caplog):
  """Dead for certain on this host (the pid is gone, or is another process now) or by SLURM's
  word (the holder was this job before SLURM requeued it), presumed dead on another host whose
  heartbeat stopped: the lock is taken with a warning naming the holder and why."""
  here = socket.gethostname()
  requeued = {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1"}
  cases = [
    (dict(host=here, pid=_dead_pid()), 0, {}, "is gone"),
    (dict(host=here, pid=os.getpid(), pid_start="1"), 0, {}, f"pid {os.getpid()} is now another"),
    (dict(host="elsewhere", pid=1), wd.STALE_AFTER_S + 60, {}, "heartbeat stopped"),
    (dict(host="elsewhere", pid=1, slurm_job="77", slurm_restart=0), 0, requeued, "requeued"),
  ]
  for record, age, env, reason in cases:
    for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT"):
      monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
      monkeypatch.setenv(name, value)
    _write_lock(tmp_path, age, **record)
    caplog.clear()
    lock = wd.WorkdirLock(tmp_path).acquire()
    try:
      assert json.loads((tmp_path / wd.LOCK_NAME).read_text())["token"] == lock._token
      assert f"host {record['host']}, pid {record['pid']}" in caplog.text
      assert reason in caplog.text, caplog.text
    finally:
      lock.release()
    assert not (tmp_path / wd.LOCK_NAME).exists()


def test_a_live_holders_lock_is_refused_unless_forced(tmp_path, caplog):
  for record, age in (
    (dict(host="elsewhere", pid=77), wd.HEARTBEAT_S),  # a recent heartbeat from another host
    (wd.WorkdirLock(tmp_path)._record(), 0),  # this very process
  ):
    path = _write_lock(tmp_path, age, **record)
    with pytest.raises(UsageError, match=f"in use by another run: host {record['host']}, pid "):
      wd.WorkdirLock(tmp_path).acquire()
    assert json.loads(path.read_text())["pid"] == record["pid"]  # untouched
    caplog.clear()
    lock = wd.WorkdirLock(tmp_path, take_over=True).acquire()
    assert "forced by take_over_lock" in caplog.text
    lock.release()


def test_a_run_whose_lock_was_taken_stops(tmp_path):
  lock = wd.WorkdirLock(tmp_path).acquire()
  try:
    assert lock.refresh()
    lock.check()
    forced = wd.WorkdirLock(tmp_path, take_over=True).acquire()
    assert not lock.refresh()
    with pytest.raises(RunError, match="the workdir lock was taken by host .* this run stops"):
      lock.check()
    forced.release()
  finally:
    lock.release()


def test_readers_ignore_the_lock_and_it_follows_the_umask(reference, tmp_path):
  """decode.py's loading and cli.average read a workdir (a copy of the reference run's) whose
  lock a run holds, and leave the lock alone; the lock file, like the rest of the workdir,
  follows the umask."""
  work = tmp_path / "w"
  shutil.copytree(reference(), work)
  previous = os.umask(0o022)
  try:
    lock = wd.WorkdirLock(work).acquire()
  finally:
    os.umask(previous)
  try:
    before = (work / wd.LOCK_NAME).read_bytes()
    assert stat.S_IMODE((work / wd.LOCK_NAME).stat().st_mode) == 0o644
    assert load_for_inference(work).step == STEPS
    assert write_average(work, 2).exists()
    assert (work / wd.LOCK_NAME).read_bytes() == before
  finally:
    lock.release()


_TAKER = """
import sys
from core.errors import UsageError
from training.workdir import WorkdirLock
print("ready", flush=True)
sys.stdin.readline()  # "go", written to the four takers at once
try:
  lock = WorkdirLock(sys.argv[1]).acquire()
except UsageError:
  print("refused", flush=True)
else:
  print("won", flush=True)
  sys.stdin.readline()  # held until the others have tried (stdin closed)
  lock.release()
"""


def test_of_several_takers_of_a_dead_lock_one_wins(tmp_path):
  """Four processes, each started and ready, try to take a dead holder's lock at once: one wins
  and holds it until the three others have been refused."""
  _write_lock(tmp_path, host=socket.gethostname(), pid=_dead_pid())
  takers = [
    subprocess.Popen(
      [sys.executable, "-c", _TAKER, str(tmp_path)],
      cwd=REPO,
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for _ in range(4)
  ]
  watchdog = threading.Timer(60, lambda: [t.kill() for t in takers])  # a ceiling, not a race
  watchdog.start()
  try:
    ready = [t.stdout.readline().strip() for t in takers]
    for t in takers:
      t.stdin.write("go\n")
      t.stdin.flush()
    results = [t.stdout.readline().strip() for t in takers]  # each one's answer, as it comes
    errors = [t.communicate(timeout=60)[1] for t in takers]  # stdin closed: the winner releases
  finally:
    watchdog.cancel()
  assert ready == ["ready"] * 4, errors
  assert sorted(results) == ["refused"] * 3 + ["won"], (results, errors)
  assert [t.returncode for t in takers] == [0] * 4, errors
