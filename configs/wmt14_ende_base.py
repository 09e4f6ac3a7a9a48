"""The paper's base model (table 3): N=6, d_model 512, d_ff 2048, h 8, dropout 0.1, label
smoothing 0.1, a shared vocabulary of 37,000 (a unigram SentencePiece model here; the paper used
BPE), ~25k padded target tokens per batch, 100k steps, WMT14 English->German from TFDS (downloads
on first use). Checkpoints every 1,000 steps (the paper wrote one every 10 minutes, about 1,500 of
its base steps), the last 5 kept for averaging.

    python train.py --config=configs/wmt14_ende_base.py --workdir=runs/base
    python -m cli.average --workdir=runs/base --last=5
    python decode.py --workdir=runs/base --checkpoint=average:5 --split=test

Not trained here (no GPU was lent): 63,045,632 parameters with this vocabulary; its train step
on 2 CPU cores is in docs/results.md.
"""

from configs import common


def get_config():
  c = common.base_config()
  c.model.update(
    vocab_size=37_000,
    d_model=512,
    d_ff=2048,
    num_heads=8,
    num_layers=6,
    dropout_rate=0.1,
    max_len=256,
  )
  c.data.update(
    name="wmt14_translate/de-en",
    source_lang="en",
    target_lang="de",
    train_split="train",
    eval_split="validation",
    vocab_size=37_000,
    tokens_per_batch=25_000,
    max_len=256,
  )
  c.optim.update(warmup_steps=4000, label_smoothing=0.1)
  c.num_train_steps = 100_000
  c.checkpoint_every_steps = 1_000
  return c
