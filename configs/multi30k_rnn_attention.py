"""Multi30k German->English, the recurrent encoder-decoder with additive (Bahdanau) attention over
every encoder state: the `rnn_attention` row of the README's Multi30k table
(bentrevett/pytorch-seq2seq: 28.3 lowercased greedy).

    timeout -s TERM 3600 python train.py --config=configs/multi30k_rnn_attention.py \
        --workdir=runs/m30k_rnn_attention
"""

from configs import multi30k_rnn


def get_config():
  c = multi30k_rnn.get_config()
  c.model.type = "rnn_attention"
  return c
