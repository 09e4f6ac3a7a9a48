"""The paper's big model (table 3): d_model 1024, d_ff 4096, h 16, dropout 0.3 (0.1 for en-fr),
300k steps, and the last 20 checkpoints kept for the paper's averaging of big models; otherwise
as base.

    python train.py --config=configs/wmt14_ende_big.py --workdir=runs/big
    python -m cli.average --workdir=runs/big --last=20

Not trained here (no GPU was lent): 214,171,648 parameters with base's vocabulary.
"""

from configs import wmt14_ende_base


def get_config():
  c = wmt14_ende_base.get_config()
  c.model.update(d_model=1024, d_ff=4096, num_heads=16, dropout_rate=0.3)
  c.num_train_steps = 300_000
  c.checkpoint.keep = 20
  return c
