"""Periodic evaluation (training/periodic.py Evaluation): the BLEU sentences are translated by one
compiled search for the whole run, not a new one at each evaluation."""

import json

import model.generate as generate_lib
from tests.helpers import tiny_config, train_run


def test_evaluations_share_one_compiled_search(tmp_path, monkeypatch):
  """Three evaluations of the same sentences trace the search once per batch shape: the jitted
  search is kept by the run (tracing calls model.generate.generate; a compiled call does not)."""
  traced = []
  real = generate_lib.generate

  def counting(model, params, inputs, *args, **kwargs):
    traced.append(tuple(inputs.shape))
    return real(model, params, inputs, *args, **kwargs)

  monkeypatch.setattr(generate_lib, "generate", counting)
  config = tiny_config(
    num_devices=1, num_train_steps=3, eval_every_steps=1, **{"eval.bleu_sentences": 8}
  )
  train_run(config, tmp_path)
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  evals = [r for r in records if r["split"] == "eval"]
  assert [r["step"] for r in evals] == [1, 2, 3] and all("bleu" in r for r in evals)
  assert traced and len(traced) == len(set(traced)), traced
