"""Every config in configs/ loads, builds its model and optimizer, and the Multi30k rows of
docs/results.md have the parameter counts their table prints. Shapes only (jax.eval_shape):
nothing compiles."""

import importlib
import math
import pathlib

import jax
import pytest

from analysis.parameters import parameter_table
from model.build import abstract_params
from training.loop import fit_model_vocab
from training.state import make_optimizer

CONFIGS = sorted(
  p.stem
  for p in (pathlib.Path(__file__).parent.parent / "configs").glob("*.py")
  if "def get_config" in p.read_text()  # the recipes, not common.py or validate.py
)

# docs/results.md's Multi30k table (shared 8000-piece vocabulary, tied embeddings).
README_PARAMS = {
  "multi30k_rnn": 4_019_200,  # 4.02M
  "multi30k_rnn_attention": 4_216_320,  # 4.22M
  "multi30k_transformer_deen": 7_568_384,  # 7.57M
  "multi30k_transformer_ende": 7_568_384,  # 7.57M
  "multi30k_transformer_tiny_ende": 2_342_912,  # 2.34M
}


def _config(name):
  config = importlib.import_module(f"configs.{name}").get_config()
  fit_model_vocab(config, config.data.vocab_size)  # as train.py does with the vocabulary it builds
  return config


def test_readme_rows_have_configs():
  assert set(README_PARAMS) <= set(CONFIGS)
  assert "multi30k" in CONFIGS and "wmt14_ende_base" in CONFIGS


@pytest.mark.parametrize("name", CONFIGS)
def test_config_builds_model_and_optimizer(name):
  config = _config(name)
  params = abstract_params(config.model)
  n = sum(size for _, _, size in parameter_table(params))
  assert n > 0
  if name in README_PARAMS:
    assert n == README_PARAMS[name], (name, n)
  tx, schedule = make_optimizer(config)
  opt_state = jax.eval_shape(tx.init, params)
  assert jax.tree.leaves(opt_state)
  # The learning rate is finite over the whole configured run.
  for step in (0, config.num_train_steps // 2, config.num_train_steps):
    assert math.isfinite(float(schedule(step)))
