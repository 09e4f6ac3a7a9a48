"""Preemption (training/preemption.py): a stop signal saves and exits 0, a hung process is ended
by the watchdog, and the handlers are put back."""

import signal
import subprocess
import sys
import threading
import time

import pytest

from inference.restore import load_for_inference
from tests.helpers import REPO, tiny_config, train_run
from training import checkpoint as ckpt
from training.preemption import Preemption

pytestmark = pytest.mark.slow  # real command-line processes or trained workdirs


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stop_signal_saves_and_exits_zero(tmp_path, sig):
  cmd = [
    sys.executable,
    str(REPO / "train.py"),
    "--config=configs/tiny.py",
    f"--workdir={tmp_path}",
    "--config.num_train_steps=100000",
    "--config.log_every_steps=1",
    "--config.eval.bleu_sentences=0",
    "--config.model.num_layers=1",
    "--config.num_devices=1",
  ]
  proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  metrics = tmp_path / "metrics.jsonl"
  deadline = time.time() + 240
  while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
    time.sleep(0.5)
  proc.send_signal(sig)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 0, err[-3000:]
  steps = ckpt.available_steps(tmp_path)
  assert len(steps) == 1 and steps[0] >= 2
  assert f"{sig.name} received: saved step {steps[0]}" in err


def test_stop_signal_on_a_checkpoint_step(tmp_path, monkeypatch):
  """A stop requested right after the periodic save of the same step: one save, a clean return."""
  calls = []

  def requested(self, step):
    calls.append(step)
    return step == 4  # just saved by checkpoint_every_steps=4

  monkeypatch.setattr(Preemption, "requested", requested)
  config = tiny_config(num_devices=1, num_train_steps=12, checkpoint_every_steps=4)
  train_run(config, tmp_path)
  assert ckpt.available_steps(tmp_path) == [4]


def test_stop_signal_handlers_are_put_back_after_training(tmp_path):
  before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
  train_run(tiny_config(num_devices=1, num_train_steps=1), tmp_path)
  assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
  assert signal.set_wakeup_fd(-1) == -1  # the watchdog's wakeup socket is detached again
  assert not [t for t in threading.enumerate() if t.name == "stop-watchdog"]


# train.py with the loop made to hang where it would act on a stop signal, as a process does when
# it waits in a collective that another process never joins.
_HANGING_TRAIN = """
import sys, time
from training.preemption import Preemption
real = Preemption.requested
def requested(self, step):
  if real(self, step):
    print("hanging", flush=True)
    while True:
      time.sleep(0.1)
  return False
Preemption.requested = requested
sys.argv = ["train.py"] + sys.argv[1:]
import train
from cli import app
train.define_flags()
app.run(train.main, prog="train.py")
"""


def test_a_process_hung_after_a_stop_signal_exits_after_stop_timeout_s(tmp_path):
  cmd = [
    sys.executable,
    "-c",
    _HANGING_TRAIN,
    "--config=configs/tiny.py",
    f"--workdir={tmp_path}",
    "--config.num_train_steps=100000",
    "--config.log_every_steps=1",
    "--config.checkpoint_every_steps=2",
    "--config.checkpoint.async_save=false",
    "--config.eval.bleu_sentences=0",
    "--config.model.num_layers=1",
    "--config.num_devices=1",
    "--config.stop_timeout_s=2",
  ]
  proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 240
  while time.time() < deadline and not ckpt.available_steps(tmp_path):
    time.sleep(0.5)
  proc.send_signal(signal.SIGTERM)
  sent = time.time()
  out, err = proc.communicate(timeout=120)
  waited = time.time() - sent
  assert "hanging" in out  # the stop signal reached the loop, which then hung
  assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
  assert 2 <= waited < 60, waited
  assert "SIGTERM received 2 s ago and the process has not stopped" in err
  steps = ckpt.available_steps(tmp_path)
  assert steps and steps[-1] % 2 == 0  # only the periodic checkpoints: no save after the signal
  assert load_for_inference(tmp_path).step == steps[-1]  # the last one is whole
