"""Multi30k German->English, Transformer (3+3 layers, d_model 256, d_ff 1024, 4 heads, ~7.6M
parameters with a shared 8000-piece vocabulary): the `transformer` row of the README's Multi30k
table, compared with bentrevett/pytorch-seq2seq's Transformer (36.5 lowercased greedy BLEU).

    timeout -s TERM 3600 python train.py --config=configs/multi30k_transformer_deen.py \
        --workdir=runs/m30k_transformer_deen

SIGTERM from `timeout` saves a checkpoint and exits cleanly; decode with
`python decode.py --workdir=... --split=test_2016_flickr --beam_size=1 --checkpoint=average:3`.
Short CPU budgets favour more, smaller updates: 2048 target tokens per step and a 400-step warmup.
One hour on both cores of the 2-core development machine: 1,896 steps, test_2016_flickr greedy
BLEU 38.77 cased / 38.98 lowercased with the last three checkpoints averaged (README).
"""

from configs import multi30k


def get_config():
  c = multi30k.get_config()
  c.data.update(source_lang="de", target_lang="en", tokens_per_batch=2048)
  c.optim.update(warmup_steps=400, learning_rate=0.7)
  c.eval_every_steps = 500
  return c
