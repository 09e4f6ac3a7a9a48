"""Multi30k German->English, Transformer (3+3 layers, d_model 256, d_ff 1024, 4 heads, ~7.6M
parameters with a shared 8000-piece vocabulary). Short CPU budgets favour more, smaller updates:
2048 target tokens per step and a 400-step warmup.

    timeout -s TERM 3600 python train.py --config=configs/multi30k_transformer_deen.py \
        --workdir=runs/m30k_transformer_deen
    python decode.py --workdir=runs/m30k_transformer_deen --split=test_2016_flickr \
        --beam_size=1 --checkpoint=average:3

The corpus is fetched on first use (`configs/multi30k.py` says how and where).

SIGTERM from `timeout` saves a checkpoint and exits cleanly. One hour on both cores of a 2-core
x86-64 CPU (1,896 steps, 2026-11-29), the last three checkpoints averaged: test_2016_flickr greedy
BLEU 38.77 cased / 38.98 lowercased (bentrevett/pytorch-seq2seq's Transformer: 36.5).
"""

from configs import multi30k


def get_config():
  c = multi30k.get_config()
  c.data.update(source_lang="de", target_lang="en", tokens_per_batch=2048)
  c.optim.update(warmup_steps=400, learning_rate=0.7)
  c.eval_every_steps = 500
  return c
