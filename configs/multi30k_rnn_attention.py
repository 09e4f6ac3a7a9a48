"""Multi30k German->English, the recurrent encoder-decoder with additive (Bahdanau) attention over
every encoder state.

    timeout -s TERM 3600 python train.py --config=configs/multi30k_rnn_attention.py \
        --workdir=runs/m30k_rnn_attention
    python decode.py --workdir=runs/m30k_rnn_attention --split=test_2016_flickr --beam_size=1

The corpus is fetched on first use (`configs/multi30k.py` says how and where).

One hour on one shared core of a 2-core x86-64 CPU (597 steps, 2026-11-29): test_2016_flickr
greedy BLEU 29.20 cased / 29.40 lowercased (bentrevett/pytorch-seq2seq: 28.3 lowercased).
"""

from configs import multi30k_rnn


def get_config():
  c = multi30k_rnn.get_config()
  c.model.type = "rnn_attention"
  return c
