"""Checkpoints: exact resume, preemption, other topologies, averaging, faults."""

import json
import logging
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from tests.test_training import REPO, tiny_config
from training import checkpoint as ckpt


def _train(config, workdir):
  from training.loop import train

  return train(config, pathlib.Path(workdir))


def _losses(workdir):
  recs = [
    json.loads(line) for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()
  ]
  return {r["step"]: r["loss"] for r in recs if r["split"] == "train"}


def _params(workdir, step):
  state, _ = ckpt.restore(ckpt.checkpoint_dir(workdir) / str(step))
  return state["params"]


def _assert_trees_equal(a, b):
  la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("full")
  config = tiny_config(
    num_devices=1,
    num_train_steps=12,
    log_every_steps=1,
    checkpoint_every_steps=4,
    **{"model.dropout_rate": 0.1},
  )
  _train(config, workdir)
  return config, workdir


def test_resume_equals_uninterrupted(uninterrupted, tmp_path):
  config, full = uninterrupted
  first = tiny_config(
    num_devices=1,
    num_train_steps=5,
    log_every_steps=1,
    checkpoint_every_steps=4,
    **{"model.dropout_rate": 0.1},
  )
  _train(first, tmp_path)  # stops at 5 (saved), as a preempted job would
  _train(config, tmp_path)  # the same command again: resumes at 5
  a, b = _losses(full), _losses(tmp_path)
  assert sorted(b) == list(range(1, 13))
  for s in range(1, 13):
    assert a[s] == b[s], (s, a[s], b[s])  # bitwise on CPU: no batch replayed or skipped
  _assert_trees_equal(_params(full, 12), _params(tmp_path, 12))


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


def test_restore_on_other_topologies(tmp_path, caplog):
  from tests.test_training import make_parallel
  from training.loop import _restore_target

  config = tiny_config(
    num_devices=8,
    num_train_steps=2,
    parallelism="mesh",
    **{"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2},
  )
  _train(config, tmp_path)
  saved = _params(tmp_path, 2)
  # 8-device mesh -> 1 device (decoding).
  restored = ckpt.load_for_inference(tmp_path)
  _assert_trees_equal(restored.params, saved)
  assert restored.step == 2 and restored.vocab.vocab_size == 36
  # -> pmap over 4 devices, and -> a 1x1x... mesh on 1 device.
  for cfg in (tiny_config(num_devices=4, parallelism="pmap"), tiny_config(num_devices=1)):
    p = make_parallel(cfg)
    step, state, meta = ckpt.Checkpointer(tmp_path, async_save=False).restore_latest(
      _restore_target(p, cfg)
    )
    state = p.place_state(state) if p.kind == "pmap" else state
    _assert_trees_equal(p.host_state(state).params, saved)
    # ... and train on from there under that topology, writing a checkpoint it can read back.
  cfg = tiny_config(num_devices=4, parallelism="pmap", num_train_steps=3)
  with caplog.at_level(logging.INFO):
    _train(cfg, tmp_path)
  assert f"resumed from {ckpt.checkpoint_dir(tmp_path) / '2'} at step 2" in caplog.text
  assert ckpt.available_steps(tmp_path)[-1] == 3
  again = ckpt.load_for_inference(tmp_path)
  assert again.step == 3
  changed = [
    not np.array_equal(a, b)
    for a, b in zip(jax.tree_util.tree_leaves(again.params), jax.tree_util.tree_leaves(saved))
  ]
  assert any(changed)  # step 3 trained on from step 2's parameters and saved the result


def test_average_is_elementwise_mean_and_ensemble_stacks(uninterrupted):
  _, workdir = uninterrupted
  steps = ckpt.available_steps(workdir)
  assert steps[-3:] == [4, 8, 12]
  out = subprocess.run(
    [sys.executable, "-m", "training.average", f"--workdir={workdir}", "--last=3"],
    cwd=REPO,
    capture_output=True,
    text=True,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  avg = ckpt.load_for_inference(workdir, "average:3").params
  trees = [_params(workdir, s) for s in (4, 8, 12)]
  for got, *xs in zip(jax.tree_util.tree_leaves(avg), *map(jax.tree_util.tree_leaves, trees)):
    np.testing.assert_allclose(
      got, np.mean(np.stack(xs).astype(np.float64), 0), rtol=1e-6, atol=1e-7
    )
  ensemble = ckpt.load_for_inference(workdir, "ensemble:3")
  assert (ensemble.ensemble, ensemble.steps, ensemble.step) == (True, (4, 8, 12), 12)
  for got, *xs in zip(
    jax.tree_util.tree_leaves(ensemble.params), *map(jax.tree_util.tree_leaves, trees)
  ):
    np.testing.assert_array_equal(got, np.stack(xs))
  out = subprocess.run(
    [sys.executable, "-m", "training.average", f"--workdir={workdir}", "--last=99"],
    cwd=REPO,
    capture_output=True,
    text=True,
  )
  assert out.returncode == 2 and "only 3 checkpoints" in out.stderr


def test_unfinished_and_corrupt_checkpoints_are_skipped(uninterrupted, tmp_path, caplog):
  _, full = uninterrupted
  work = tmp_path / "w"
  shutil.copytree(full, work)
  root = ckpt.checkpoint_dir(work)
  (root / "16.orbax-checkpoint-tmp-1234").mkdir()  # a save killed half way
  _damage(root / "12")  # the newest finished one
  from tests.test_training import make_parallel
  from training.loop import _restore_target

  config = tiny_config(num_devices=1)
  p = make_parallel(config)
  with caplog.at_level(logging.WARNING):
    step, state, meta = ckpt.Checkpointer(work, async_save=False).restore_latest(
      _restore_target(p, config)
    )
  assert step == 8
  text = caplog.text
  assert "16.orbax-checkpoint-tmp-1234" in text and str(root / "12") in text


def test_shape_mismatch_and_missing_checkpoints_are_clear(uninterrupted, tmp_path):
  config, full = uninterrupted
  work = tmp_path / "w"
  shutil.copytree(full, work)
  bigger = tiny_config(num_devices=1, num_train_steps=20, **{"model.d_model": 64})
  with pytest.raises(ValueError, match=r"model.d_model: checkpoint 32 != config 64"):
    _train(bigger, work)
  with pytest.raises(FileNotFoundError, match="no checkpoint in .* contains: notes.txt"):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("x")
    ckpt.load_for_inference(tmp_path / "empty")
  with pytest.raises(ValueError, match="no checkpoint at step 7; available steps: "):
    ckpt.load_for_inference(full, "7")


@pytest.mark.parametrize(
  "change",
  [
    {"optim.clip_norm": 1.0},
    {"optim.weight_decay": 0.01},
    {"optim.schedule": "cosine", "optim.learning_rate": 1e-3},
  ],
)
def test_resume_with_optimizer_settings_changed(uninterrupted, tmp_path, change, caplog):
  """The loop's non-finite error suggests optim.clip_norm, and the README allows weight decay or
  the schedule to change on resume: the run must continue (the optimizer state keeps its
  layout), not start again from step 0; what changed is logged."""
  config, full = uninterrupted
  work = tmp_path / "w"
  shutil.copytree(full, work)
  changed = tiny_config(
    num_devices=1,
    num_train_steps=14,
    log_every_steps=1,
    checkpoint_every_steps=4,
    **{"model.dropout_rate": 0.1, **change},
  )
  with caplog.at_level(logging.WARNING):
    _train(changed, work)
  key = next(iter(change))
  assert "resuming with a changed recipe: the checkpoint's config differs in optim." in caplog.text
  assert f"{key}: checkpoint" in caplog.text
  assert "num_train_steps: checkpoint 12 != config 14" in caplog.text
  steps = [
    json.loads(line)["step"]
    for line in (work / "metrics.jsonl").read_text().splitlines()
    if json.loads(line)["split"] == "train"
  ]
  assert steps == list(range(1, 15)), steps  # 13 and 14 appended; nothing re-trained from 1


def test_state_that_does_not_fit_is_an_error_naming_the_arrays(uninterrupted, tmp_path):
  config, full = uninterrupted
  from tests.test_training import make_parallel
  from training.loop import _restore_target

  target = _restore_target(make_parallel(config), config)
  emb = target.params["embed"]["embedding"]
  params = dict(
    target.params,
    extra=jax.ShapeDtypeStruct((2,), np.float32),
    embed={
      "embedding": jax.ShapeDtypeStruct(
        (emb.shape[0] + 1, emb.shape[1]), emb.dtype, sharding=emb.sharding
      )
    },
  )
  bad = target.replace(params=params)
  with pytest.raises(ValueError) as e:
    ckpt.Checkpointer(full, async_save=False).restore_latest(bad, explain=lambda meta: "HINT")
  msg = str(e.value)
  assert (
    "does not fit this run's training state" in msg and str(ckpt.checkpoint_dir(full) / "12") in msg
  )
  assert "checkpoint lacks: params/extra" in msg, msg
  assert (
    f"params/embed/embedding ({emb.shape[0]}, {emb.shape[1]}) != ({emb.shape[0] + 1}," in msg
  ), msg
  assert msg.endswith("HINT")
  # pre_ln keeps most shapes but changes the model: refused by name before any array is read.
  work = tmp_path / "w"
  shutil.copytree(full, work)
  with pytest.raises(ValueError, match=r"model.pre_ln: checkpoint False != config True"):
    _train(tiny_config(num_devices=1, num_train_steps=20, **{"model.pre_ln": True}), work)
  assert ckpt.available_steps(work) == ckpt.available_steps(full)


def test_rerunning_a_finished_run_does_nothing(uninterrupted, tmp_path):
  config, full = uninterrupted
  work = tmp_path / "w"
  shutil.copytree(full, work)
  before = (work / "metrics.jsonl").read_text()
  assert _train(config, work) == {}
  assert (work / "metrics.jsonl").read_text() == before
  assert ckpt.available_steps(work) == ckpt.available_steps(full)


def test_stop_signal_on_a_checkpoint_step(tmp_path, monkeypatch):
  """A stop requested right after the periodic save of the same step: one save, a clean return."""
  from training import loop

  calls = []

  def requested(self, step):
    calls.append(step)
    return step == 4  # just saved by checkpoint_every_steps=4

  monkeypatch.setattr(loop._Preemption, "requested", requested)
  config = tiny_config(num_devices=1, num_train_steps=12, checkpoint_every_steps=4)
  _train(config, tmp_path)
  assert ckpt.available_steps(tmp_path) == [4]


def test_keep_best_keeps_the_highest_bleu(tmp_path):
  c = ckpt.Checkpointer(tmp_path, keep=1, keep_best=1, async_save=False)
  for step, bleu in zip((1, 2, 3, 4), (10.0, 30.0, 5.0, 20.0)):
    c.save(step, {"x": np.full((2,), step, np.float32)}, {"step": step}, metrics={"bleu": bleu})
  c.close()
  assert ckpt.available_steps(tmp_path) == [2, 4]  # best (30 at step 2) and latest


def test_keep_best_survives_a_restart(tmp_path):
  """The best checkpoint's BLEU is on disk: a resumed run (a new manager) still keeps it."""
  c = ckpt.Checkpointer(tmp_path, keep=1, keep_best=1, async_save=False)
  for step, bleu in ((1, 10.0), (2, 30.0), (3, None)):
    c.save(
      step,
      {"x": np.full((2,), step, np.float32)},
      {"step": step},
      metrics=None if bleu is None else {"bleu": bleu},
    )
  c.close()
  assert ckpt.available_steps(tmp_path) == [2, 3]
  c = ckpt.Checkpointer(tmp_path, keep=1, keep_best=1, async_save=False)  # the run resumed
  for step in (4, 5):
    c.save(step, {"x": np.full((2,), step, np.float32)}, {"step": step})
  c.close()
  assert ckpt.available_steps(tmp_path) == [2, 5]


def test_a_damaged_metrics_file_is_set_aside_and_the_run_resumes(tmp_path, caplog):
  """A truncated `<step>/metrics/metrics` made Orbax's manager fail to start (a JSON traceback):
  it is renamed, that checkpoint counts as unscored, and its state still restores."""
  c = ckpt.Checkpointer(tmp_path, keep=2, keep_best=1, async_save=False)
  for step, bleu in ((1, 30.0), (2, 10.0)):
    c.save(step, {"x": np.full((2,), step, np.float32)}, {"step": step}, metrics={"bleu": bleu})
  c.close()
  metrics = ckpt.checkpoint_dir(tmp_path) / "1" / "metrics" / "metrics"
  metrics.write_text(metrics.read_text()[:5])
  with caplog.at_level(logging.WARNING):
    c = ckpt.Checkpointer(tmp_path, keep=2, keep_best=1, async_save=False)
  assert "its metrics file could not be read" in caplog.text and str(metrics) in caplog.text
  assert not metrics.exists() and metrics.with_name("metrics.unreadable").exists()
  abstract = {"x": jax.ShapeDtypeStruct((2,), np.float32)}
  step, state, _ = c.restore_latest(abstract)
  assert step == 2 and np.all(np.asarray(state["x"]) == 2)
  c.save(3, {"x": np.full((2,), 3, np.float32)}, {"step": 3}, metrics={"bleu": 20.0})
  c.close()
  assert ckpt.available_steps(tmp_path) == [2, 3]  # step 1, now unscored, is no longer kept


def _damage(folder):
  for f in (folder / "state").rglob("*"):
    if f.is_file() and f.stat().st_size > 100:
      f.write_bytes(f.read_bytes()[:50])


def test_training_on_after_an_unreadable_checkpoint_saves_that_step_again(uninterrupted, tmp_path):
  """Step 12 is damaged: the run resumes from 8, sets 12 aside and writes a new step 12, equal to
  the uninterrupted run's (before, Orbax declined every save up to 12 and the final one raised)."""
  config, full = uninterrupted
  work = tmp_path / "w"
  shutil.copytree(full, work)
  _damage(ckpt.checkpoint_dir(work) / "12")
  _train(config, work)
  assert ckpt.available_steps(work) == [4, 8, 12]
  assert (ckpt.checkpoint_dir(work) / "12.unreadable-0").is_dir()
  _assert_trees_equal(_params(work, 12), _params(full, 12))


def test_no_restorable_checkpoint_is_an_error_not_a_fresh_start(uninterrupted, tmp_path):
  config, full = uninterrupted
  work = tmp_path / "w"
  shutil.copytree(full, work)
  for step in ckpt.available_steps(work):
    _damage(ckpt.checkpoint_dir(work) / str(step))
  with pytest.raises(
    RuntimeError,
    match=r"none of the 3 checkpoints in .* could be restored "
    r"\(newest first: 12: ",
  ):
    _train(config, work)
  assert ckpt.available_steps(work) == [4, 8, 12]
  assert (work / "metrics.jsonl").read_text() == (full / "metrics.jsonl").read_text()


@pytest.mark.parametrize(
  "error",
  [MemoryError("cannot allocate"), ValueError("RESOURCE_EXHAUSTED: Out of memory allocating")],
)
def test_a_machine_failure_on_restore_skips_and_moves_nothing(
  uninterrupted, tmp_path, monkeypatch, error
):
  """Out of memory (or an unavailable file system) says nothing about the checkpoint: no fallback
  to an older step, no renaming, an error."""
  _, full = uninterrupted
  work = tmp_path / "w"
  shutil.copytree(full, work)

  def failing(path, abstract_state=None):
    raise error

  monkeypatch.setattr(ckpt, "restore", failing)
  from tests.test_training import make_parallel
  from training.loop import _restore_target

  config = tiny_config(num_devices=1)
  with pytest.raises(
    RuntimeError,
    match=r"checkpoint .*12 could not be restored .*a problem of "
    r"this machine",
  ):
    ckpt.Checkpointer(work, async_save=False).restore_latest(
      _restore_target(make_parallel(config), config)
    )
  assert sorted(p.name for p in ckpt.checkpoint_dir(work).iterdir()) == ["12", "4", "8"]


def test_processes_that_found_different_checkpoints_stop_together(monkeypatch):
  from jax.experimental import multihost_utils

  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: np.array([12, 8]))
  with pytest.raises(RuntimeError, match=r"different newest readable checkpoints .*\[12, 8\]"):
    ckpt._agree_across_processes(12, pathlib.Path("ckpts"))
  monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: np.array([8, 8]))
  ckpt._agree_across_processes(8, pathlib.Path("ckpts"))


def test_vocab_path_is_copied_into_the_workdir_and_decoding_checks_it(uninterrupted, tmp_path):
  """data.vocab_path: the workdir alone decodes once the original file is gone; a vocabulary
  other than the checkpoint's is refused by name instead of decoding wrong words."""
  from data import tokenizer

  _, full = uninterrupted
  outside = tmp_path / "mine.json"
  shutil.copy(full / "vocab.json", outside)
  work = tmp_path / "w"
  _train(tiny_config(num_devices=1, num_train_steps=2, **{"data.vocab_path": str(outside)}), work)
  outside.unlink()
  (work / "vocab.model").write_bytes(b"stale, not a SentencePiece model")  # tried first, skipped
  restored = ckpt.load_for_inference(work)
  assert restored.vocab.fingerprint == tokenizer.load_vocab(full / "vocab.json").fingerprint
  (work / "vocab.model").unlink()
  words = restored.vocab.words
  tokenizer.WordVocab(list(reversed(words))).save(work / "vocab.json")  # same size, other ids
  with pytest.raises(
    ValueError,
    match=r"were trained with vocabulary word-\w+, but .*vocab.json: "
    r"word-\w+: decoding with another vocabulary",
  ):
    ckpt.load_for_inference(work)


def test_stop_signal_handlers_are_put_back_after_training(tmp_path):
  before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
  _train(tiny_config(num_devices=1, num_train_steps=1), tmp_path)
  assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
  assert signal.set_wakeup_fd(-1) == -1  # the watchdog's wakeup socket is detached again
  assert not [t for t in threading.enumerate() if t.name == "stop-watchdog"]


# train.py with the loop made to hang where it would act on a stop signal, as a process does when
# it waits in a collective that another process never joins.
_HANGING_TRAIN = """
import sys, time
from absl import app
from training import loop
real = loop._Preemption.requested
def requested(self, step):
  if real(self, step):
    print("hanging", flush=True)
    while True:
      time.sleep(0.1)
  return False
loop._Preemption.requested = requested
sys.argv = ["train.py"] + sys.argv[1:]
import train
from configs.flags import parse
app.run(train.main, flags_parser=parse)
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
    "--config.stop_timeout_s=4",
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
  assert 4 <= waited < 60, waited
  assert "SIGTERM received 4 s ago and the process has not stopped" in err
  steps = ckpt.available_steps(tmp_path)
  assert steps and steps[-1] % 2 == 0  # only the periodic checkpoints: no save after the signal
  assert ckpt.load_for_inference(tmp_path).step == steps[-1]  # the last one is whole


def test_averaging_unevenly_spaced_steps_warns(caplog):
  with caplog.at_level(logging.INFO):
    ckpt._report_average([4, 8, 12, 14], interval=4)  # the last step may be off the interval
    ckpt._report_average([4, 8, 12, 14])
  assert "averaging the parameters of steps 4, 8, 12, 14" in caplog.text
  assert "not evenly spaced" not in caplog.text
  with caplog.at_level(logging.INFO):
    ckpt._report_average([1000, 6000, 7000], interval=1000)  # a keep_best checkpoint among them
  assert "averaging steps 1000, 6000, 7000: they are not evenly spaced" in caplog.text
  with caplog.at_level(logging.INFO):
    ckpt._report_average([1000, 5000, 6000, 7000])  # interval unknown: the gaps disagree
  assert "averaging steps 1000, 5000, 6000, 7000: they are not evenly spaced" in caplog.text


def test_keep_best_through_training_ranks_each_checkpoint_by_its_own_eval(tmp_path, monkeypatch):
  """Checkpoints every 2 steps, evaluations every 4: only steps 4, 8, 12 (and the final 16) have
  a BLEU of their own; step 6 must not inherit step 4's."""
  from training import evaluate

  bleus = iter([30.0, 10.0, 5.0, 1.0])
  monkeypatch.setattr(evaluate, "translation_metrics", lambda *a, **k: {"bleu": next(bleus)})
  config = tiny_config(
    num_devices=1,
    num_train_steps=16,
    checkpoint_every_steps=2,
    eval_every_steps=4,
    **{"checkpoint.keep": 1, "checkpoint.keep_best": 1, "eval.bleu_sentences": 4},
  )
  _train(config, tmp_path)
  assert ckpt.available_steps(tmp_path) == [4, 16]


def test_average_needs_at_least_one_checkpoint(uninterrupted):
  _, workdir = uninterrupted
  with pytest.raises(
    ValueError, match=r"--last=0: the number of checkpoints to average must be >= 1"
  ):
    ckpt.write_average(workdir, 0)
  out = subprocess.run(
    [sys.executable, "-m", "training.average", f"--workdir={workdir}", "--last=0"],
    cwd=REPO,
    capture_output=True,
    text=True,
  )
  assert out.returncode != 0 and "--last=0" in out.stderr, out.stderr[-2000:]
  assert not (pathlib.Path(workdir) / ckpt.AVERAGE_DIR / "last0").exists()


def test_resume_with_another_vocabulary_is_refused(uninterrupted, tmp_path):
  from data import tokenizer

  config, full = uninterrupted
  work = tmp_path / "w"
  shutil.copytree(full, work)
  words = tokenizer.load_vocab(work / "vocab.json").words
  other = tmp_path / "other.json"
  tokenizer.WordVocab(list(reversed(words))).save(other)  # same size, other ids
  moved = tiny_config(
    num_devices=1, num_train_steps=20, **{"model.dropout_rate": 0.1, "data.vocab_path": str(other)}
  )
  with pytest.raises(ValueError, match=r"was trained with vocabulary word-\w+, this run has word-"):
    _train(moved, work)
  assert ckpt.available_steps(work) == ckpt.available_steps(full)


def test_resume_with_another_data_vocab_size_is_refused(tmp_path):
  rng = np.random.default_rng(0)
  words = "the a cat dog sat on mat ran to house big small red green der die das hund".split()
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  for lang in ("en", "de"):
    for split, n in (("train", 300), ("val", 20)):
      (corpus / f"{split}.{lang}").write_text(
        "".join(" ".join(rng.choice(words, 5)) + "\n" for _ in range(n))
      )
  files = {
    "data.name": "files",
    "data.dir": str(corpus),
    "data.source_lang": "en",
    "data.target_lang": "de",
    "data.train_split": "train",
    "data.eval_split": "val",
    "data.vocab_size": 60,
    "model.vocab_size": 0,
    "eval.bleu_sentences": 0,
  }
  work = tmp_path / "w"
  _train(tiny_config(num_devices=1, num_train_steps=2, **files), work)
  with pytest.raises(ValueError, match=r"data.vocab_size: checkpoint 60 != config 70"):
    _train(
      tiny_config(num_devices=1, num_train_steps=4, **dict(files, **{"data.vocab_size": 70})), work
    )
  assert ckpt.available_steps(work) == [2]
