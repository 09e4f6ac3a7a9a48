"""Multi30k English->German, Transformer-tiny (4+4 layers, d_model 128, d_ff 256, 4 heads, shared
8000-piece vocabulary) with dropout 0.3: the architecture and regularization of the Revisit-MMT
text-only baseline (41.0 lowercased), with a recipe sized for a fixed 2-hour CPU budget.

    timeout -s TERM 7200 python train.py --config=configs/multi30k_transformer_tiny_ende.py \
        --workdir=runs/m30k_transformer_tiny_ende
    python decode.py --workdir=runs/m30k_transformer_tiny_ende --split=val --beam_size=5

A step of 4096 target tokens costs about what a 2048-token step of `multi30k_transformer_ende.py`'s
d_model-256 model does on the 2-core machine (about 0.5 steps/s), so this model sees about twice
the data in the budget; dropout 0.3 instead of 0.1 because it is a small model on a small corpus.
The learning rate decays to zero by `num_train_steps`, set a little under what two hours reach.
"""
from configs import multi30k


def get_config():
  c = multi30k.get_config()
  c.model.update(d_model=128, d_ff=256, num_heads=4, num_layers=4, dropout_rate=0.3,
                 attention_dropout_rate=0.0)
  c.data.update(tokens_per_batch=4096)
  c.optim.update(schedule="cosine", learning_rate=4e-3, warmup_steps=800, clip_norm=1.0)
  c.num_train_steps = 3_800
  c.eval_every_steps = 1_000
  return c
