"""Early stopping (config.early_stopping, training/periodic.py EarlyStopping): evaluations without
a gain end the run with a final checkpoint and one line; a resumed run goes on counting."""

import logging

import ml_collections
import pytest

from core.errors import UsageError
from tests.helpers import tiny_config, train_run
from training import checkpoint as ckpt
from training import evaluate
from training.periodic import EarlyStopping
from training.validate import check_config


def _settings(metric="bleu", patience=2, min_delta=0.0):
  return ml_collections.ConfigDict(dict(metric=metric, patience=patience, min_delta=min_delta))


@pytest.mark.parametrize(
  "metric, values, waited",
  [
    ("bleu", [10.0, 12.0, 12.0, 11.0], 2),  # a tie is no gain
    ("bleu", [10.0, 9.0, 10.5], 0),
    ("loss", [2.0, 1.5, 1.6, 1.3], 0),
    ("loss", [2.0, 2.1, 1.95], 2),  # 0.05 below the best: less than min_delta 0.1
  ],
)
def test_evaluations_without_a_gain_are_counted(metric, values, waited):
  stopping = EarlyStopping(_settings(metric, patience=2, min_delta=0.1 if metric == "loss" else 0))
  for step, value in enumerate(values, 1):
    stopping.observe(step, {metric: value})
  assert stopping.waited == waited and stopping.stop == (waited >= 2)
  again = EarlyStopping(_settings(metric, patience=3), stopping.state())  # a resumed run
  assert (again.best, again.best_step, again.waited) == (stopping.best, stopping.best_step, waited)
  assert (
    EarlyStopping(_settings("bleu" if metric == "loss" else "loss"), stopping.state()).waited == 0
  )


def test_bleu_without_bleu_sentences_is_a_config_error():
  config = tiny_config(**{"early_stopping.patience": 2})  # tiny_config measures no BLEU
  with pytest.raises(UsageError, match="early_stopping.metric='bleu' needs eval.bleu_sentences"):
    check_config(config)
  config.early_stopping.patience = 0
  check_config(config)


@pytest.mark.slow
def test_a_stalled_run_stops_and_a_resume_keeps_the_count(tmp_path, monkeypatch, caplog):
  """Evaluations every 2 steps, BLEU 30 then lower: with patience 3, the run of 5 steps has waited
  2 evaluations (steps 4 and 5), so resumed it stops at its next one, step 6."""
  caplog.set_level(logging.WARNING)
  bleus = iter([30.0, 10.0, 20.0, 25.0, 40.0])
  monkeypatch.setattr(evaluate, "translation_metrics", lambda *a, **k: {"bleu": next(bleus)})
  fields = {
    "eval.bleu_sentences": 4,
    "early_stopping.patience": 3,
    "checkpoint.keep": 1,
    "checkpoint.keep_best": 1,
  }
  first = dict(num_devices=1, eval_every_steps=2, checkpoint_every_steps=2, **fields)
  train_run(tiny_config(num_train_steps=5, **first), tmp_path)
  _, meta = ckpt.restore(ckpt.checkpoint_dir(tmp_path) / "5")
  assert meta["early_stopping"] == {"metric": "bleu", "best": 30.0, "best_step": 2, "waited": 2}
  final = train_run(tiny_config(num_train_steps=40, **first), tmp_path)
  assert final["bleu"] == 25.0
  assert ckpt.available_steps(tmp_path) == [2, 6]  # the best (checkpoint.keep_best) and the last
  line = (
    "early stopping at step 6: val bleu has not beaten its best in 3 evaluations "
    "(early_stopping.patience=3); best bleu 30.0000 at step 2"
  )
  assert caplog.text.count(line) == 1
  caplog.clear()
  assert train_run(tiny_config(num_train_steps=40, **first), tmp_path) == {}  # stays stopped
  assert line + "; raise early_stopping.patience to continue" in caplog.text
  assert ckpt.available_steps(tmp_path) == [2, 6]
