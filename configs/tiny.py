"""A tiny Transformer (2+2 layers, d_model 64) on the built-in synthetic task: tests and CPU
demos."""

from configs import common


def get_config():
  c = common.base_config()
  c.model.update(d_model=64, d_ff=128, num_heads=4, num_layers=2, dropout_rate=0.0, max_len=64)
  c.data.update(name="synthetic", tokens_per_batch=1024, max_len=32)
  c.optim.update(warmup_steps=100, label_smoothing=0.0)
  c.num_train_steps = 200
  c.log_every_steps = 20
  c.eval_every_steps = 100
  c.checkpoint_every_steps = 100
  c.eval.bleu_sentences = 64
  return c
