"""A real two-process job on localhost: two train.py processes joined by jax.distributed."""

import json
import os
import re
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.test_training import REPO

ARGS = [
  "--config=configs/tiny.py",
  "--config.num_train_steps=5",
  "--config.log_every_steps=1",
  "--config.eval.bleu_sentences=0",
  "--config.model.num_layers=1",
  "--config.model.d_model=32",
  "--config.model.d_ff=64",
  "--config.data.tokens_per_batch=256",
  "--config.data.max_len=16",
  "--config.data.synthetic_max_len=6",
  "--config.checkpoint.async_save=false",
]


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(devices):
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  env["JAX_PLATFORMS"] = "cpu"
  return env


@pytest.mark.parametrize("parallelism", ["mesh", "pmap"])
def test_two_process_job_agrees_and_only_process_0_writes(tmp_path, parallelism):
  port = _free_port()
  job, single = tmp_path / "job", tmp_path / "single"
  procs = []
  try:
    for pid in range(2):
      cmd = [
        sys.executable,
        str(REPO / "train.py"),
        *ARGS,
        f"--workdir={job}",
        f"--config.parallelism={parallelism}",
        f"--coordinator_address=127.0.0.1:{port}",
        "--num_processes=2",
        f"--process_id={pid}",
      ]
      if parallelism == "mesh":  # translate with parameters spread over both processes' devices
        cmd.append("--config.eval.bleu_sentences=4")
      procs.append(
        subprocess.Popen(
          cmd, cwd=REPO, env=_env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
      )
    # The same 4 devices in one process, run alongside (compiling is mostly single-threaded, so
    # three processes share the two cores better than two and then one).
    procs.append(
      subprocess.Popen(
        [
          sys.executable,
          str(REPO / "train.py"),
          *ARGS,
          f"--workdir={single}",
          f"--config.parallelism={parallelism}",
        ],
        cwd=REPO,
        env=_env(4),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
      )
    )
    outs = [p.communicate(timeout=400) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  losses = [re.findall(r"\[train\] step (\d+): .*?loss=([0-9.e+-]+)", err) for _, err in outs[:2]]
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

  # The same 4 devices in one process see the same global batches: the losses match, so the two
  # processes read disjoint halves of each batch (not, say, the same half twice).
  def train_losses(path):
    return [
      json.loads(line)["loss"]
      for line in (path / "metrics.jsonl").read_text().splitlines()
      if json.loads(line)["split"] == "train"
    ]

  assert len(train_losses(single)) == 5
  np.testing.assert_allclose(train_losses(job), train_losses(single), rtol=1e-4)


def test_unreachable_coordinator_fails_within_timeout(tmp_path):
  port = _free_port()  # nothing listens there
  t0 = time.time()
  out = subprocess.run(
    [
      sys.executable,
      str(REPO / "train.py"),
      *ARGS,
      f"--workdir={tmp_path}",
      f"--coordinator_address=127.0.0.1:{port}",
      "--num_processes=2",
      "--process_id=1",
      "--distributed_timeout=5",
    ],
    cwd=REPO,
    env=_env(1),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert out.returncode == 1
  assert "could not join the distributed job" in out.stderr and f"127.0.0.1:{port}" in out.stderr
  assert time.time() - t0 < 60
