"""Fine-tuning from another workdir's checkpoint (config.init_from, training/finetune.py): the
source's parameters and vocabulary, a fresh optimizer, step count and data position; a restart
resumes the fine-tuning; bad sources are one-line errors before any step; the source is only
read."""

import functools
import hashlib
import logging
import shutil

import jax
import numpy as np
import pytest

from data import pipeline as data_pipeline
from tests.helpers import (
  assert_trees_equal,
  make_parallel,
  run_in_process,
  saved_params,
  tiny_config,
  train_losses,
  train_run,
)
from training import checkpoint as ckpt
from training import evaluate
from training.average import average_params

pytestmark = pytest.mark.slow  # trained workdirs


def _snapshot(folder):
  """{path: (content hash, modification time)} of every file and folder below `folder`."""
  return {
    p.relative_to(folder): (
      hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None,
      p.stat().st_mtime_ns,
    )
    for p in sorted(folder.rglob("*"))
  }


def _finetune_config(source, spec=":latest", **overrides):
  """The source's model without dropout on another synthetic task and seed, from `source`."""
  fields = dict(num_devices=1, num_train_steps=2, log_every_steps=1, checkpoint_every_steps=1)
  fields.update(seed=1, init_from=f"{source}{spec}", **{"data.synthetic_seed": 1})
  return tiny_config(**{**fields, **overrides})


@functools.cache
def _one_device():
  """The one-device `Parallel` whose evaluation step computes the reference losses (one program
  for the file's tests)."""
  return make_parallel(tiny_config(num_devices=1))


def _source_loss(config, params, workdir):
  """The loss of `params` on the first train batch a fresh run of `config` gets."""
  batch_multiple = 2 if config.parallelism == "pmap" or config.mesh.fsdp > 1 else 1
  batch = next(data_pipeline.build(config, workdir, batch_multiple=batch_multiple).train_iter())
  return evaluate.loss_metrics(_one_device(), params, [batch])["loss"]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
  """A tiny run of 2 steps, a checkpoint at every step (the fine-tuning's step compiles the
  same program: the same model and shapes)."""
  workdir = tmp_path_factory.mktemp("source")
  train_run(tiny_config(num_devices=1, num_train_steps=2, checkpoint_every_steps=1), workdir)
  return workdir


@pytest.fixture(scope="module")
def finetuned(source, tmp_path_factory):
  """(config, workdir, source, the source's snapshot before): 2 steps fine-tuned from the
  source's step 2, a checkpoint at every step."""
  before = _snapshot(source)
  config = _finetune_config(source)
  workdir = tmp_path_factory.mktemp("finetuned")
  train_run(config, workdir)
  return config, workdir, source, before


def test_the_first_step_is_the_source_model_with_a_fresh_optimizer(finetuned, tmp_path):
  config, workdir, source, before = finetuned
  expected = _source_loss(config, saved_params(source, 2), tmp_path)
  np.testing.assert_allclose(train_losses(workdir)[1], expected, rtol=1e-5)
  state, meta = ckpt.restore(ckpt.checkpoint_dir(workdir) / "1")
  assert int(state["step"]) == 1  # the source was at 2
  adam = state["opt_state"]["adam"]
  assert int(adam["count"]) == 1
  # Adam's moments after one update from zero: mu = (1-b1) g, nu = (1-b2) g^2 = 2 mu^2.
  for mu, nu in zip(*(map(np.asarray, jax.tree_util.tree_leaves(adam[k])) for k in ("mu", "nu"))):
    np.testing.assert_allclose(nu, 2.0 * mu**2, rtol=1e-3, atol=1e-12)
  assert meta["data_state"] != ckpt.restore(ckpt.checkpoint_dir(source) / "2")[1]["data_state"]
  assert (workdir / "vocab.json").read_bytes() == (source / "vocab.json").read_bytes()
  assert _snapshot(source) == before  # only read: no lock, no file written or touched


def test_a_restart_resumes_the_finetuning_not_the_source(finetuned, tmp_path, caplog):
  caplog.set_level(logging.INFO)
  config, workdir, _, _ = finetuned
  again = tmp_path / "again"
  shutil.copytree(workdir, again)
  shutil.rmtree(ckpt.checkpoint_dir(again) / "2")
  moved = config.copy_and_resolve_references()
  moved.init_from = str(tmp_path / "gone")  # not read again once the workdir has checkpoints
  train_run(moved, again)
  assert "resumed from" in caplog.text
  assert_trees_equal(saved_params(workdir, 2), saved_params(again, 2))


@pytest.mark.parametrize(
  "spec, overrides",
  [(":average:2", {"parallelism": "pmap", "num_devices": 2})],
)
def test_finetuning_on_other_topologies_and_checkpoints(source, tmp_path, spec, overrides):
  config = _finetune_config(source, spec, num_train_steps=1, **overrides)
  train_run(config, tmp_path / "run")
  steps = [1, 2] if spec.startswith(":average") else [int(spec[1:])]
  params = average_params([saved_params(source, s) for s in steps])
  expected = _source_loss(config, params, tmp_path / "data")
  np.testing.assert_allclose(train_losses(tmp_path / "run")[1], expected, rtol=1e-5)


def test_another_model_shape_is_one_line_naming_the_parameter(source, tmp_path):
  out = run_in_process(
    "train.py",
    "--config=configs/tiny.py",
    f"--workdir={tmp_path / 'run'}",
    f"--config.init_from={source}",
    "--config.num_devices=1",
    "--config.model.num_layers=1",
    "--config.model.num_heads=4",
    "--config.model.vocab_size=36",
    "--config.data.max_len=16",
    "--config.data.synthetic_num_train=200",
    "--config.model.max_len=32",
    "--config.eval.bleu_sentences=0",
  )
  assert out.returncode == 2, out.stderr[-2000:]
  line = out.stderr.strip().splitlines()[-1]
  assert line.startswith("train.py: error: config error: init_from=")
  assert "parameter " in line and "shape (" in line and "in this config's model" in line
  assert "model.d_model: source 32 != config 64" in line
  assert not (tmp_path / "run").exists()  # from the checkpoint's metadata, before any work


@pytest.mark.parametrize(
  "spec, overrides, message",
  [
    ("", {"data.synthetic_vocab": 20}, r"data.synthetic_vocab=20 makes vocabulary word-\w+, but"),
    (":7", {}, "no checkpoint at step 7; available steps: 1, 2"),
    (":average:4", {}, "average:4 needs 1 to 2 checkpoints"),
    (":ensemble:2", {}, "an ensemble cannot start one model"),
  ],
)
def test_bad_sources_are_refused_before_the_workdir_is_made(
  source, tmp_path, spec, overrides, message
):
  with pytest.raises(ValueError, match=message):
    train_run(_finetune_config(source, spec, **overrides), tmp_path / "run")
  assert not (tmp_path / "run").exists()
