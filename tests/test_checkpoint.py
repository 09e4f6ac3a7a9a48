"""The resume checkpointer (training/checkpoint.py, training/compatibility.py): exact resume,
other topologies, keep-best, and damaged, missing or unfitting checkpoints."""

import builtins
import errno
import functools
import gc
import json
import logging
import os
import pathlib
import shutil
import threading
import time

import jax
import numpy as np
import pytest

from cluster import orbax_private
from inference.restore import load_for_inference
from tests.helpers import (
  assert_trees_equal,
  make_parallel,
  saved_params,
  tiny_config,
  train_losses,
  train_run,
)
from training import checkpoint as ckpt


@functools.cache
def one_device():
  """The one-device `Parallel` (its restore target) of the tests that restore the `uninterrupted`
  run's checkpoints: one for the file."""
  return make_parallel(tiny_config(num_devices=1))


@pytest.mark.slow
def test_resume_equals_uninterrupted(uninterrupted, tmp_path):
  config, full = uninterrupted
  first = tiny_config(
    num_devices=1,
    num_train_steps=5,
    log_every_steps=1,
    checkpoint_every_steps=4,
    **{"model.dropout_rate": 0.1},
  )
  train_run(first, tmp_path)  # stops at 5 (saved), as a preempted job would
  train_run(config, tmp_path)  # the same command again: resumes at 5
  a, b = train_losses(full), train_losses(tmp_path)
  assert sorted(b) == list(range(1, 13))
  for s in range(1, 13):
    assert a[s] == b[s], (s, a[s], b[s])  # bitwise on CPU: no batch replayed or skipped
  assert_trees_equal(saved_params(full, 12), saved_params(tmp_path, 12))


@pytest.mark.slow
def test_restore_on_other_topologies(uninterrupted, tmp_path, caplog):
  """A checkpoint an 8-device (2, 2, 2) mesh saved restores on one device (decoding), on a pmap
  over 4 devices and on a one-device mesh, equal to what was saved, and a pmap run trains on from
  it. The mesh run resumes the uninterrupted run's step 4 (one device's checkpoint, restored into
  the mesh's shardings: no initialization to compile) and saves step 5."""
  _, full = uninterrupted
  shutil.copytree(full, tmp_path, dirs_exist_ok=True)
  for step in (8, 12):
    shutil.rmtree(ckpt.checkpoint_dir(tmp_path) / str(step))
  config = tiny_config(
    num_devices=8,
    num_train_steps=5,
    parallelism="mesh",
    **{"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2},
  )
  with caplog.at_level(logging.INFO):
    train_run(config, tmp_path)
  assert f"resumed from {ckpt.checkpoint_dir(tmp_path) / '4'} at step 4" in caplog.text
  assert ckpt.available_steps(tmp_path)[-1] == 5
  saved = saved_params(tmp_path, 5)
  # 8-device mesh -> 1 device (decoding).
  restored = load_for_inference(tmp_path)
  assert_trees_equal(restored.params, saved)
  assert restored.step == 5 and restored.vocab.vocab_size == 36
  # -> pmap over 4 devices, and -> a 1x1x... mesh on 1 device.
  for p in (make_parallel(tiny_config(num_devices=4, parallelism="pmap")), one_device()):
    step, state, meta = ckpt.Checkpointer(tmp_path, async_save=False).restore_latest(
      p.restore_target
    )
    assert step == 5
    state = p.from_restored(state)
    assert_trees_equal(p.host_state(state).params, saved)
    # ... and train on from there under that topology, writing a checkpoint it can read back.
  cfg = tiny_config(num_devices=4, parallelism="pmap", num_train_steps=6)
  caplog.clear()
  with caplog.at_level(logging.INFO):
    train_run(cfg, tmp_path)
  assert f"resumed from {ckpt.checkpoint_dir(tmp_path) / '5'} at step 5" in caplog.text
  assert ckpt.available_steps(tmp_path)[-1] == 6
  again = load_for_inference(tmp_path)
  assert again.step == 6
  changed = [
    not np.array_equal(a, b)
    for a, b in zip(jax.tree_util.tree_leaves(again.params), jax.tree_util.tree_leaves(saved))
  ]
  assert any(changed)  # step 6 trained on from step 5's parameters and saved the result


@pytest.mark.slow
def test_unfinished_and_corrupt_checkpoints_are_skipped(uninterrupted, tmp_path, caplog):
  _, full = uninterrupted
  work = tmp_path / "w"
  shutil.copytree(full, work)
  root = ckpt.checkpoint_dir(work)
  (root / "16.orbax-checkpoint-tmp-1234").mkdir()  # a save killed half way
  _damage(root / "12")  # the newest finished one
  with caplog.at_level(logging.WARNING):
    step, state, meta = ckpt.Checkpointer(work, async_save=False).restore_latest(
      one_device().restore_target
    )
  assert step == 8
  text = caplog.text
  assert "16.orbax-checkpoint-tmp-1234" in text and str(root / "12") in text


@pytest.mark.slow
def test_resume_with_optimizer_settings_changed(uninterrupted, tmp_path, caplog):
  """The loop's non-finite error suggests optim.clip_norm, and the README allows weight decay or
  the schedule to change on resume: with all three changed the run must continue (the optimizer
  state keeps its layout), not start again from step 0; each change is logged."""
  config, full = uninterrupted
  work = tmp_path / "w"
  shutil.copytree(full, work)
  change = {
    "optim.clip_norm": 1.0,
    "optim.weight_decay": 0.01,
    "optim.schedule": "cosine",
    "optim.learning_rate": 1e-3,
  }
  changed = tiny_config(
    num_devices=1,
    num_train_steps=14,
    log_every_steps=1,
    checkpoint_every_steps=4,
    **{"model.dropout_rate": 0.1, **change},
  )
  with caplog.at_level(logging.WARNING):
    train_run(changed, work)
  assert "resuming with a changed recipe: the checkpoint's config differs in optim." in caplog.text
  for key in change:
    assert f"{key}: checkpoint" in caplog.text, key
  assert "num_train_steps: checkpoint 12 != config 14" in caplog.text
  steps = [
    json.loads(line)["step"]
    for line in (work / "metrics.jsonl").read_text().splitlines()
    if json.loads(line)["split"] == "train"
  ]
  assert steps == list(range(1, 15)), steps  # 13 and 14 appended; nothing re-trained from 1


@pytest.mark.slow
def test_state_that_does_not_fit_is_an_error_naming_the_arrays(uninterrupted, tmp_path):
  _, full = uninterrupted
  target = one_device().restore_target
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
    train_run(tiny_config(num_devices=1, num_train_steps=20, **{"model.pre_ln": True}), work)
  assert ckpt.available_steps(work) == ckpt.available_steps(full)


@pytest.mark.slow
def test_rerunning_a_finished_run_does_nothing(uninterrupted, tmp_path):
  config, full = uninterrupted
  work = tmp_path / "w"
  shutil.copytree(full, work)
  before = (work / "metrics.jsonl").read_text()
  assert train_run(config, work) == {}
  assert (work / "metrics.jsonl").read_text() == before
  assert ckpt.available_steps(work) == ckpt.available_steps(full)


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


@pytest.mark.slow
def test_training_on_after_an_unreadable_checkpoint_saves_that_step_again(uninterrupted, tmp_path):
  """Step 12 is damaged: the run resumes from 8, sets 12 aside and writes a new step 12, equal to
  the uninterrupted run's (before, Orbax declined every save up to 12 and the final one raised)."""
  config, full = uninterrupted
  work = tmp_path / "w"
  shutil.copytree(full, work)
  _damage(ckpt.checkpoint_dir(work) / "12")
  train_run(config, work)
  assert ckpt.available_steps(work) == [4, 8, 12]
  assert (ckpt.checkpoint_dir(work) / "12.unreadable-0").is_dir()
  assert_trees_equal(saved_params(work, 12), saved_params(full, 12))


@pytest.mark.slow
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
    train_run(config, work)
  assert ckpt.available_steps(work) == [4, 8, 12]
  assert (work / "metrics.jsonl").read_text() == (full / "metrics.jsonl").read_text()


@pytest.mark.slow
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
  with pytest.raises(
    RuntimeError,
    match=r"checkpoint .*12 could not be restored .*a problem of "
    r"this machine",
  ):
    ckpt.Checkpointer(work, async_save=False).restore_latest(one_device().restore_target)
  assert sorted(p.name for p in ckpt.checkpoint_dir(work).iterdir()) == ["12", "4", "8"]


def test_processes_that_found_different_checkpoints_stop_together(monkeypatch):
  from jax.experimental import multihost_utils

  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: np.array([12, 8]))
  with pytest.raises(RuntimeError, match=r"different newest readable checkpoints .*\[12, 8\]"):
    ckpt._agree_across_processes(12, pathlib.Path("ckpts"))
  monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: np.array([8, 8]))
  ckpt._agree_across_processes(8, pathlib.Path("ckpts"))


def test_keep_best_through_training_ranks_each_checkpoint_by_its_own_eval(tmp_path, monkeypatch):
  """Checkpoints every 2 steps, evaluations every 4: only step 4 (and the final 8) has a BLEU of
  its own; step 6 must not inherit step 4's. (Dropout as in the `uninterrupted` run: its step
  program serves.)"""
  from training import evaluate

  bleus = iter([30.0, 10.0])
  monkeypatch.setattr(evaluate, "translation_metrics", lambda *a, **k: {"bleu": next(bleus)})
  config = tiny_config(
    num_devices=1,
    num_train_steps=8,
    checkpoint_every_steps=2,
    eval_every_steps=4,
    **{
      "checkpoint.keep": 1,
      "checkpoint.keep_best": 1,
      "eval.bleu_sentences": 4,
      "model.dropout_rate": 0.1,
    },
  )
  train_run(config, tmp_path)
  assert ckpt.available_steps(tmp_path) == [4, 8]


@pytest.mark.slow
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
    train_run(moved, work)
  assert ckpt.available_steps(work) == ckpt.available_steps(full)


def test_resume_with_another_data_vocab_size_is_refused(tmp_path):
  """A vocabulary the run trains itself (model.vocab_size fitted to it): another data.vocab_size
  is refused on resume. (36 ids, dropout as in the `uninterrupted` run: the same shapes, so its
  step programs serve.)"""
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
    "data.vocab_size": 36,
    "model.vocab_size": 0,
    "model.dropout_rate": 0.1,
    "eval.bleu_sentences": 0,
  }
  work = tmp_path / "w"
  train_run(tiny_config(num_devices=1, num_train_steps=2, **files), work)
  with pytest.raises(ValueError, match=r"data.vocab_size: checkpoint 36 != config 40"):
    train_run(
      tiny_config(num_devices=1, num_train_steps=4, **dict(files, **{"data.vocab_size": 40})), work
    )
  assert ckpt.available_steps(work) == [2]


@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited")  # the cancelled writes'
@pytest.mark.parametrize("async_save", [True, False])
@pytest.mark.parametrize("fault", ["mkdir", "write"])
def test_a_failed_save_is_one_error_and_leaves_no_thread_waiting(
  tmp_path, monkeypatch, async_save, fault
):
  """The disk fills up (os.makedirs, which Orbax calls through etils.epath to create the step's
  temporary folder, or builtins.open, with which it writes the JSON metadata inside it, raises
  ENOSPC for that folder): the call that finds it (save, or check once the background write is
  over) raises one RunError naming the step and the reason; none of Orbax's threads is left
  waiting for the failed step (they kept the process alive for 300 s); the previous checkpoint
  is intact and the manager closes."""
  checkpointer = ckpt.Checkpointer(tmp_path, async_save=async_save)
  state = {"w": np.arange(6.0, dtype=np.float32)}
  checkpointer.save(1, state, {"step": 1})
  checkpointer.wait()
  real = {"mkdir": os.makedirs, "write": builtins.open}[fault]

  def full_disk(path, *args, **kwargs):
    mode = args[0] if args else kwargs.get("mode", "r")
    if "2.orbax-checkpoint-tmp" in str(path) and (fault == "mkdir" or "w" in mode):
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return real(path, *args, **kwargs)

  monkeypatch.setattr(*((os, "makedirs") if fault == "mkdir" else (builtins, "open")), full_disk)
  with pytest.raises(ckpt.RunError) as raised:
    checkpointer.save(2, state, {"step": 2})
    deadline = time.time() + 30
    while time.time() < deadline:
      checkpointer.check()
      time.sleep(0.01)
  monkeypatch.undo()
  message = str(raised.value)
  assert message.startswith(f"could not save checkpoint {tmp_path / 'checkpoints' / '2'} (No space")
  assert f"the last finished checkpoint, {tmp_path / 'checkpoints' / '1'}, is intact" in message
  waiting = orbax_private.signaling_threads()
  for t in waiting:
    threading.Thread.join(t, timeout=5)
  assert not [t for t in waiting if t.is_alive()]
  checkpointer.close()
  del checkpointer, waiting
  gc.collect()  # the cancelled writes' coroutines, under this test's warning filter
  assert ckpt.available_steps(tmp_path) == [1]
  restored, meta = ckpt.restore(ckpt.checkpoint_dir(tmp_path) / "1")
  assert meta == {"step": 1} and np.array_equal(restored["w"], state["w"])


def test_a_checkpoint_folder_that_cannot_be_written_is_refused_before_any_work(tmp_path):
  """Found before the data is read and the first step: a UsageError naming the folder, and
  nothing written in the workdir but the folder itself."""
  (tmp_path / "checkpoints").write_text("a file where the folder should be")
  with pytest.raises(ckpt.UsageError, match=f"checkpoint folder {tmp_path / 'checkpoints'}: not"):
    train_run(tiny_config(num_devices=1), tmp_path)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]
