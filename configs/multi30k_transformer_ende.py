"""Multi30k English->German, Transformer (3+3 layers, d_model 256): the en->de row of the README's
Multi30k table, decoded with beam 5 and scored lowercased as the Revisit-MMT text-only baseline
(41.0) is. The model and recipe are `configs/multi30k.py`'s.

    timeout -s TERM 7200 python train.py --config=configs/multi30k_transformer_ende.py \
        --workdir=runs/m30k_transformer_ende
    python decode.py --workdir=runs/m30k_transformer_ende --split=test_2016_flickr --beam_size=5 \
        --alpha=1.5 --checkpoint=average:3

(length penalty and averaging chosen on val; the README row: test 37.27 cased / 37.62 lowercased).
"""
from configs import multi30k


def get_config():
  return multi30k.get_config()
