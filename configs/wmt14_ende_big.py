"""The paper's big model (table 3): d_model 1024, d_ff 4096, h 16, dropout 0.3 (0.1 for en-fr),
300k steps, and the last 20 checkpoints kept for the paper's averaging of big models
(`python -m training.average --workdir=<dir> --last=20`); otherwise as base."""

from configs import wmt14_ende_base


def get_config():
  c = wmt14_ende_base.get_config()
  c.model.update(d_model=1024, d_ff=4096, num_heads=16, dropout_rate=0.3)
  c.num_train_steps = 300_000
  c.checkpoint.keep = 20
  return c
