"""The README quick start: a tiny Transformer (2+2 layers, d_model 64) learns the built-in
synthetic task (reverse the sentence and translate every word) on a CPU in a few minutes.

    python train.py --config=configs/default.py --workdir=/tmp/quickstart

Its time and validation exact match: docs/results.md, "Quick start, data pipeline, tests".
"""

from configs import common


def get_config():
  c = common.base_config()
  c.model.update(d_model=64, d_ff=256, num_heads=4, num_layers=2, dropout_rate=0.0, max_len=64)
  c.data.update(name="synthetic", tokens_per_batch=2048, max_len=32)
  c.optim.update(warmup_steps=200, learning_rate=2.0, label_smoothing=0.0)
  c.num_train_steps = 1500
  c.log_every_steps = 100
  c.eval_every_steps = 500
  c.checkpoint_every_steps = 500
  c.eval.bleu_sentences = 500
  return c
