"""configs/default.py cut down for the tests and quick demos: a narrower feed-forward layer, half
the batch and 200 steps; evaluations every 100 steps."""

from configs import default


def get_config():
  c = default.get_config()
  c.model.d_ff = 128
  c.data.tokens_per_batch = 1024
  c.optim.update(warmup_steps=100, learning_rate=1.0)
  c.num_train_steps = 200
  c.log_every_steps = 20
  c.eval_every_steps = 100
  c.checkpoint_every_steps = 100
  c.eval.bleu_sentences = 64
  return c
