"""Multi30k English->German, the en->de row of the README's Multi30k table: the Transformer-tiny
shape of the Revisit-MMT text-only baseline (4+4 layers, d_model 128, d_ff 256, 4 heads, dropout
0.3), decoded with beam 5 and scored lowercased as that baseline (41.0) is. Data and vocabulary
(shared 8000-piece SentencePiece) are `configs/multi30k.py`'s.

    timeout -s TERM 7200 python train.py --config=configs/multi30k_transformer_ende.py \
        --workdir=runs/m30k_transformer_ende
    python -m training.average --workdir=runs/m30k_transformer_ende --last=5
    python decode.py --workdir=runs/m30k_transformer_ende --checkpoint=average:5 \
        --split=test_2016_flickr --beam_size=5

On 2 CPU cores a step (4096 padded target tokens) takes about 1.8 s, so the 2-hour budget is
about 4000 steps (35 epochs): the warmup is short and the peak rate high (about 0.004) to use it.
"""
from configs import multi30k


def get_config():
  c = multi30k.get_config()
  c.model.update(d_model=128, d_ff=256, num_heads=4, num_layers=4, dropout_rate=0.3,
                 attention_dropout_rate=0.1)
  c.optim.update(warmup_steps=1000, learning_rate=1.5)
  c.eval_every_steps = 1000
  c.checkpoint_every_steps = 250
  return c
