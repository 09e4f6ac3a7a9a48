"""Real two-process jobs on localhost: two train.py processes joined by jax.distributed, through
its flags or a cluster's environment; a coordinator that cannot be reached."""

import concurrent.futures
import json
import re
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.helpers import JOB_ARGS, REPO, cpu_env, free_port, train_losses

pytestmark = pytest.mark.slow  # real command-line processes or trained workdirs


def run_together(jobs, timeout=400):
  """Starts each (argv, env) of `jobs` at once and waits for all; their (stdout, stderr), once
  every one has exited 0."""
  procs = []
  try:
    for argv, env in jobs:
      procs.append(
        subprocess.Popen(
          argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
      )
    outs = [p.communicate(timeout=timeout) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  return outs


def logged_losses(stderr: str) -> list[tuple[str, str]]:
  """(step, loss) of each train line a process logged (process 0's and the others' alike)."""
  return re.findall(r"\[train\] step (\d+): .*?loss=([0-9.e+-]+)", stderr)


# train.py, run as the main program, printing what JAX made of the environment when training
# starts.
_REPORTING_TRAIN = """
import runpy, sys
import jax
import training.loop
real_train = training.loop.train
def train(*args, **kwargs):
  print(f"process {jax.process_index()} of {jax.process_count()}", flush=True)
  return real_train(*args, **kwargs)
training.loop.train = train
sys.argv = ["train.py"] + sys.argv[1:]
runpy.run_path("train.py", run_name="__main__")
"""


def _slurm_task(env: dict, task: int) -> dict:
  """`env` as `srun` gives task `task` of 2 on one host (the variables
  jax/_src/clusters/slurm_cluster.py reads), with JAX_COORDINATOR_PORT and no other cluster's."""
  env = {
    k: v
    for k, v in env.items()
    if not k.startswith(("SLURM_", "OMPI_", "PMI_", "KUBERNETES_", "TPU_", "JAX_COORDINATOR"))
  }
  return dict(
    env,
    SLURM_JOB_ID="4242",
    SLURM_JOB_NUM_NODES="1",
    SLURM_NNODES="1",
    SLURM_NODELIST="localhost",
    SLURM_STEP_NODELIST="localhost",
    SLURM_STEP_NUM_NODES="1",
    SLURM_NTASKS="2",
    SLURM_STEP_NUM_TASKS="2",
    SLURM_TASKS_PER_NODE="2",
    SLURM_PROCID=str(task),
    SLURM_LOCALID=str(task),
    SLURM_NODEID="0",
  )


LAUNCHES = {"mesh-flags": ("mesh", "flags", 2), "pmap-slurm": ("pmap", "slurm", 1)}


def _job(workdir, parallelism, launch, devices) -> list:
  """(argv, env) of each of a 2-process job's processes, `devices` CPU devices each."""
  port = free_port()
  train = [sys.executable, "-c", _REPORTING_TRAIN, *JOB_ARGS, f"--config.parallelism={parallelism}"]
  jobs = []
  for pid in range(2):
    cmd, env = [*train, f"--workdir={workdir}"], cpu_env(devices)
    if launch == "flags":
      cmd += [f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", f"--process_id={pid}"]
    else:
      env = dict(_slurm_task(env, pid), JAX_COORDINATOR_PORT=str(port))
    if parallelism == "mesh":  # translate with parameters spread over both processes' devices
      cmd.append("--config.eval.bleu_sentences=4")
    jobs.append((cmd, env))
  return jobs


@pytest.fixture(scope="module")
def two_process_jobs(tmp_path_factory):
  """{launch id: (job workdir, its two processes' (stdout, stderr))} of both LAUNCHES, and
  "single": (workdir, [(stdout, stderr)]) of one process with the jobs' two devices (mesh), all
  started at once (compiling is mostly single-threaded, so five processes share the two cores
  better than one job after the other); the two jobs share the one-process reference, their
  losses equal to it up to rtol 1e-4 as pmap's and a mesh's are on one process
  (tests/test_training.py)."""
  root = tmp_path_factory.mktemp("jobs")
  jobs = [process for name, launch in LAUNCHES.items() for process in _job(root / name, *launch)]
  single = [sys.executable, "-c", _REPORTING_TRAIN, *JOB_ARGS, "--config.parallelism=mesh"]
  jobs.append(([*single, f"--workdir={root / 'single'}"], cpu_env(2)))
  outs = run_together(jobs)
  return {
    **{name: (root / name, outs[2 * i : 2 * i + 2]) for i, name in enumerate(LAUNCHES)},
    "single": (root / "single", outs[-1:]),
  }


@pytest.mark.parametrize("name", list(LAUNCHES))
def test_two_process_job_agrees_and_only_process_0_writes(two_process_jobs, name):
  """Two train.py processes of 2 (mesh) or 1 (pmap) CPU devices each form one job, joined by the
  --coordinator_address / --num_processes / --process_id flags, or with no flags by JAX's cluster
  detection in the environment `srun` gives each task (and JAX_COORDINATOR_PORT). Both log the
  same losses, only process 0 writes, and one process with both processes' devices, run
  alongside, logs the same losses too."""
  parallelism = LAUNCHES[name][0]
  job, outs = two_process_jobs[name]
  single, (single_out,) = two_process_jobs["single"]
  assert "process 0 of 2" in outs[0][0] and "process 1 of 2" in outs[1][0]
  assert "process 0 of 1" in single_out[0]
  losses = [logged_losses(err) for _, err in outs]
  assert [int(s) for s, _ in losses[0]] == [1, 2, 3, 4, 5]
  assert [(s, float(x)) for s, x in losses[0]] == [(s, float(x)) for s, x in losses[1]], (
    outs[0][1][-3000:],
    outs[1][1][-3000:],
  )
  # Only process 0 writes metrics (5 train records + 1 eval) and the summary line.
  lines = (job / "metrics.jsonl").read_text().splitlines()
  assert len(lines) == 6
  assert json.loads(lines[-1])["split"] == "eval"
  assert ("bleu" in json.loads(lines[-1])) == (parallelism == "mesh")
  assert "final:" in outs[0][0] and "final:" not in outs[1][0]
  assert (job / "checkpoints" / "5").is_dir()
  # The same devices in one process see the same global batches: the losses match, so the two
  # processes read disjoint halves of each batch (not, say, the same half twice).
  alone = train_losses(single)
  assert sorted(alone) == [1, 2, 3, 4, 5]
  np.testing.assert_allclose(list(train_losses(job).values()), list(alone.values()), rtol=1e-4)


def _join_unreachable(workdir, listening: bool) -> tuple[subprocess.CompletedProcess, int, float]:
  """train.py as process 1 of 2 whose coordinator is a port nothing listens at, or one whose
  service accepts the connection and never answers; (its run, the port, the seconds it took)."""
  with socket.socket() as server:
    server.bind(("127.0.0.1", 0))
    if listening:
      server.listen(8)
    port = server.getsockname()[1]
    t0 = time.time()
    out = subprocess.run(
      [
        sys.executable,
        str(REPO / "train.py"),
        *JOB_ARGS,
        f"--workdir={workdir}",
        f"--coordinator_address=127.0.0.1:{port}",
        "--num_processes=2",
        "--process_id=1",
        "--distributed_timeout=2",
      ],
      cwd=REPO,
      env=cpu_env(1),
      capture_output=True,
      text=True,
      timeout=120,
    )
  return out, port, time.time() - t0


@pytest.fixture(scope="module")
def unreachable(tmp_path_factory):
  """{listening: _join_unreachable's result}: both cases run at once (each mostly waits out its
  timeout)."""
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    runs = {
      listening: pool.submit(_join_unreachable, tmp_path_factory.mktemp("unreachable"), listening)
      for listening in (False, True)
    }
    return {listening: run.result() for listening, run in runs.items()}


@pytest.mark.parametrize("listening", [False, True], ids=["nothing_listens", "never_answers"])
def test_an_unreachable_or_silent_coordinator_fails_within_timeout(unreachable, listening):
  """Nothing listens at the coordinator's address, or a service accepts the connection and never
  answers (the wrong port, a hung coordinator: JAX would wait out its timeout and then abort the
  process with a C++ stack trace): one line, exit status 1, within --distributed_timeout."""
  out, port, waited = unreachable[listening]
  assert out.returncode == 1, out.stderr[-3000:]
  assert out.stderr.count("\n") == 1 and "Check failed" not in out.stderr, out.stderr[-3000:]
  assert f"could not join the distributed job at coordinator 127.0.0.1:{port} within 2 s" in (
    out.stderr
  )
  assert ("never answered" in out.stderr) == listening
  assert 2 <= waited < 60, waited
