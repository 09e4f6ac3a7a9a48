"""Loading a workdir for decoding (inference/restore.py) and checkpoint averaging
(training/average.py): latest, a step, average:k, ensemble:k, the vocabulary check."""

import logging
import pathlib
import shutil

import jax
import numpy as np
import pytest

from inference.restore import load_for_inference
from tests.helpers import (
  assert_trees_equal,
  run_in_process,
  run_py,
  saved_params,
  tiny_config,
  train_run,
)
from training import checkpoint as ckpt
from training.average import AVERAGE_DIR, report_average, write_average
from training.checkpoint import restore_params


@pytest.mark.slow
def test_average_is_elementwise_mean_and_ensemble_stacks(uninterrupted):
  _, workdir = uninterrupted
  steps = ckpt.available_steps(workdir)
  assert steps[-3:] == [4, 8, 12]
  out = run_py("-m", "cli.average", f"--workdir={workdir}", "--last=3")
  assert out.returncode == 0, out.stderr[-2000:]
  avg = load_for_inference(workdir, "average:3").params
  trees = [saved_params(workdir, s) for s in (4, 8, 12)]
  for got, *xs in zip(jax.tree_util.tree_leaves(avg), *map(jax.tree_util.tree_leaves, trees)):
    np.testing.assert_allclose(
      got, np.mean(np.stack(xs).astype(np.float64), 0), rtol=1e-6, atol=1e-7
    )
  ensemble = load_for_inference(workdir, "ensemble:3")
  assert (ensemble.ensemble, ensemble.steps, ensemble.step) == (True, (4, 8, 12), 12)
  for got, *xs in zip(
    jax.tree_util.tree_leaves(ensemble.params), *map(jax.tree_util.tree_leaves, trees)
  ):
    np.testing.assert_array_equal(got, np.stack(xs))
  out = run_in_process("cli.average", f"--workdir={workdir}", "--last=99")
  last = out.stderr.strip().splitlines()[-1]
  assert out.returncode == 2 and last.startswith("cli.average: error: --last=99: only 3 ")
  with pytest.raises(ValueError, match=r"^last=99: only 3 checkpoints in "):  # Python's names
    write_average(workdir, 99)


@pytest.mark.slow
def test_vocab_path_is_copied_into_the_workdir_and_decoding_checks_it(uninterrupted, tmp_path):
  """data.vocab_path: the workdir alone decodes once the original file is gone; a vocabulary
  other than the checkpoint's is refused by name instead of decoding wrong words."""
  from data import tokenizer

  _, full = uninterrupted
  outside = tmp_path / "mine.json"
  shutil.copy(full / "vocab.json", outside)
  work = tmp_path / "w"
  train_run(
    tiny_config(num_devices=1, num_train_steps=2, **{"data.vocab_path": str(outside)}), work
  )
  outside.unlink()
  (work / "vocab.model").write_bytes(b"stale, not a SentencePiece model")  # tried first, skipped
  restored = load_for_inference(work)
  assert restored.vocab.fingerprint == tokenizer.load_vocab(full / "vocab.json").fingerprint
  (work / "vocab.model").unlink()
  words = restored.vocab.words
  tokenizer.WordVocab(list(reversed(words))).save(work / "vocab.json")  # same size, other ids
  with pytest.raises(
    ValueError,
    match=r"were trained with vocabulary word-\w+, but .*vocab.json: "
    r"word-\w+: decoding with another vocabulary",
  ):
    load_for_inference(work)


def test_averaging_unevenly_spaced_steps_warns(caplog):
  with caplog.at_level(logging.INFO):
    report_average([4, 8, 12, 14], interval=4)  # the last step may be off the interval
    report_average([4, 8, 12, 14])
  assert "averaging the parameters of steps 4, 8, 12, 14" in caplog.text
  assert "not evenly spaced" not in caplog.text
  with caplog.at_level(logging.INFO):
    report_average([1000, 6000, 7000], interval=1000)  # a keep_best checkpoint among them
  assert "averaging steps 1000, 6000, 7000: they are not evenly spaced" in caplog.text
  with caplog.at_level(logging.INFO):
    report_average([1000, 5000, 6000, 7000])  # interval unknown: the gaps disagree
  assert "averaging steps 1000, 5000, 6000, 7000: they are not evenly spaced" in caplog.text


@pytest.mark.slow
def test_average_needs_at_least_one_checkpoint(uninterrupted):
  _, workdir = uninterrupted
  with pytest.raises(
    ValueError, match=r"^last=0: the number of checkpoints to average must be >= 1"
  ):
    write_average(workdir, 0)
  out = run_in_process("cli.average", f"--workdir={workdir}", "--last=0")
  assert out.returncode == 2 and "flag --last=0: must be >= 1" in out.stderr, out.stderr[-2000:]
  assert not (pathlib.Path(workdir) / AVERAGE_DIR / "last0").exists()


@pytest.mark.slow
def test_shape_mismatch_and_missing_checkpoints_are_clear(uninterrupted, tmp_path):
  config, full = uninterrupted
  work = tmp_path / "w"
  shutil.copytree(full, work)
  bigger = tiny_config(num_devices=1, num_train_steps=20, **{"model.d_model": 64})
  with pytest.raises(ValueError, match=r"model.d_model: checkpoint 32 != config 64"):
    train_run(bigger, work)
  with pytest.raises(FileNotFoundError, match="no checkpoint in .* contains: notes.txt"):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("x")
    load_for_inference(tmp_path / "empty")
  with pytest.raises(ValueError, match="no checkpoint at step 7; available steps: "):
    load_for_inference(full, "7")


@pytest.mark.slow
def test_bad_checkpoints_are_named_as_python_arguments(uninterrupted):
  """The library names its argument as the caller wrote it (decode.py's `--checkpoint=...` lines,
  tests/test_decode.py, are the same errors as the command line prints them)."""
  _, workdir = uninterrupted
  for checkpoint, message in (
    ("nonsense", "checkpoint='nonsense': expected latest, a step number, average:<k> or"),
    ("average:x", "checkpoint='average:x': expected average:<k> with k an integer"),
    (
      "ensemble:9",
      "checkpoint='ensemble:9': ensemble:9 needs 1 to 3 checkpoints; available steps: 4,",
    ),
    (7, "checkpoint='7': no checkpoint at step 7; available steps: 4, 8, 12"),
  ):
    with pytest.raises(ValueError) as raised:
      load_for_inference(workdir, checkpoint)
    assert str(raised.value).startswith(message), raised.value


@pytest.mark.slow
def test_loading_a_translator_changes_no_logger(uninterrupted):
  """Translator.load installs no filter on absl's logger or handler (the library changes no
  global logging state); `inference.quiet_library_logs()` is the explicit call."""
  from absl import logging as absl_logging

  from inference import Translator

  absl_logger = logging.getLogger("absl")
  before = (list(absl_logger.filters), list(absl_logging.get_absl_handler().filters))
  Translator.load(uninterrupted[1])
  assert (list(absl_logger.filters), list(absl_logging.get_absl_handler().filters)) == before


def test_decoding_reads_the_parameters_only(uninterrupted, tmp_path):
  """Checkpoints written one array per folder (Orbax without OCDBT), then the data of every
  array but the parameters deleted (the optimizer's moments and counters, the step): training's
  full restore fails, decoding restores the same parameters as before, for 'latest',
  'average:k' and 'ensemble:k'."""
  import orbax.checkpoint as ocp

  _, full = uninterrupted
  work = tmp_path / "w"
  shutil.copytree(full, work, ignore=shutil.ignore_patterns("checkpoints", "averaged"))
  handlers = dict(
    state=ocp.PyTreeCheckpointHandler(use_ocdbt=False), meta=ocp.JsonCheckpointHandler()
  )
  for step in (8, 12):
    state, meta = ckpt.restore(ckpt.checkpoint_dir(full) / str(step))
    folder = ckpt.checkpoint_dir(work) / str(step)
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler(**handlers)) as checkpointer:
      checkpointer.save(
        folder,
        args=ocp.args.Composite(state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(meta)),
      )
    others = [
      p for p in (folder / "state").iterdir() if p.is_dir() and p.name.split(".")[0] != "params"
    ]
    assert {p.name.split(".")[0] for p in others} == {"opt_state", "step", "nonfinite_streak"}
    for chunk in (c for p in others for c in p.iterdir() if c.name != ".zarray"):
      chunk.unlink()  # the array's data gone, its shape and dtype (.zarray) kept
  with pytest.raises(Exception):  # noqa: B017 - whatever Orbax raises for the missing arrays
    ckpt.restore(ckpt.checkpoint_dir(work) / "12")
  params, meta = restore_params(ckpt.checkpoint_dir(work) / "12")
  assert_trees_equal(params, saved_params(full, 12))
  assert meta["step"] == 12
  for checkpoint in ("latest", "average:2", "ensemble:2"):
    assert_trees_equal(
      load_for_inference(work, checkpoint).params, load_for_inference(full, checkpoint).params
    )


def test_parameters_restore_from_the_shapes_meta_recorded(uninterrupted, tmp_path):
  """Training's checkpoints record the parameters' shapes in meta, and `restore_params` reads
  the parameters by them (no Orbax metadata of every array); a checkpoint without them (written
  before) restores the same parameters; shapes meta has wrong are an OSError naming the folder."""
  import json

  _, full = uninterrupted
  folder = ckpt.checkpoint_dir(full) / "12"
  meta = json.loads((folder / "meta" / "metadata").read_text())
  params = saved_params(full, 12)
  shapes = jax.tree_util.tree_map(lambda x: list(x.shape), params)
  assert meta[ckpt.PARAM_SHAPES] == shapes
  restored, restored_meta = restore_params(folder)
  assert_trees_equal(restored, params)
  assert restored_meta[ckpt.PARAM_SHAPES] == shapes and restored_meta["step"] == 12

  older = tmp_path / "12"
  shutil.copytree(folder, older)
  del meta[ckpt.PARAM_SHAPES]
  (older / "meta" / "metadata").write_text(json.dumps(meta))
  assert_trees_equal(restore_params(older)[0], params)

  wrong = json.loads(json.dumps(shapes))  # a copy, one parameter's shape changed
  node = wrong
  while isinstance(node, dict):
    key = next(iter(node))
    if isinstance(node[key], list):
      node[key] = [d + 1 for d in node[key]]
      break
    node = node[key]
  (older / "meta" / "metadata").write_text(json.dumps(dict(meta, **{ckpt.PARAM_SHAPES: wrong})))
  with pytest.raises(OSError, match="do not have the shapes meta recorded"):
    restore_params(older)


def test_parameter_copies_restore_as_orbax_and_are_renewed_when_the_checkpoint_is(
  uninterrupted, tmp_path, monkeypatch, caplog
):
  """inference/params_copy.py: the first restore writes a copy, the next reads it (the same
  params and meta as `restore_params`) in a process that never imports Orbax; a damaged copy is
  restored again with a warning; a checkpoint written again gets a new copy; only KEEP stay."""
  from inference import params_copy
  from inference.params_copy import ParamsCopies

  _, full = uninterrupted
  work = tmp_path / "w"
  shutil.copytree(full, work, ignore=shutil.ignore_patterns("averaged"))
  folder = ckpt.checkpoint_dir(work) / "12"
  want_params, want_meta = restore_params(folder)
  copies = ParamsCopies(tmp_path / "copies")
  for read in (0, 1):
    params, meta = copies.restore(folder)
    assert_trees_equal(params, want_params)
    assert meta == want_meta and (copies.read, copies.written) == (read, 1)
  (copy,) = (tmp_path / "copies").glob("*.npz")

  read = f"ParamsCopies({str(tmp_path / 'copies')!r}).restore"
  report = (
    "import sys; from inference.params_copy import ParamsCopies; "
    "from inference.restore import load_for_inference; "
    f"r = load_for_inference({str(work)!r}, read={read}); "
    "print(r.step, sorted(m for m in sys.modules if m.startswith('orbax.checkpoint.'))[:3])"
  )
  out = run_py("-c", report)
  assert out.returncode == 0 and out.stdout.split("\n")[-2] == "12 []", out.stderr[-2000:]

  copy.write_bytes(copy.read_bytes()[:1000])  # cut short
  with caplog.at_level(logging.WARNING):
    params, _ = ParamsCopies(tmp_path / "copies").restore(folder)
  assert_trees_equal(params, want_params)
  assert "could not be read" in caplog.text and copy.stat().st_size > 1000

  shutil.rmtree(folder)  # the step saved anew: same folder, new files
  shutil.copytree(ckpt.checkpoint_dir(full) / "8", folder)
  monkeypatch.setattr(params_copy, "KEEP", 1)
  copies = ParamsCopies(tmp_path / "copies")
  params, meta = copies.restore(folder)
  assert_trees_equal(params, saved_params(full, 8))
  assert meta["step"] == 8 and (copies.read, copies.written) == (0, 1)
  assert [p.name for p in (tmp_path / "copies").glob("*.npz")] != [copy.name]
  assert len(list((tmp_path / "copies").glob("*.npz"))) == 1
