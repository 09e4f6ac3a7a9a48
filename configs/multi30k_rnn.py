"""Multi30k German->English, recurrent encoder-decoder whose only link is the context vector
(bidirectional GRU encoder, GRU decoder initialised from and fed the final states; Cho et al. 2014).
Adam at a constant 1e-3 after a short warmup and gradient clipping at 1, as is usual for RNNs.

    timeout -s TERM 3600 python train.py --config=configs/multi30k_rnn.py --workdir=runs/m30k_rnn
    python decode.py --workdir=runs/m30k_rnn --split=test_2016_flickr --beam_size=1

The corpus is fetched on first use (`configs/multi30k.py` says how and where).

One hour on one shared core of a 2-core x86-64 CPU (1,446 steps, 2026-11-29): test_2016_flickr
greedy BLEU 23.79 cased / 23.99 lowercased (bentrevett/pytorch-seq2seq: 20.6 lowercased).
"""

from configs import multi30k


def get_config():
  c = multi30k.get_config()
  c.model.update(
    type="rnn", d_model=256, num_layers=1, dropout_rate=0.3, rnn_cell="gru", rnn_bidirectional=True
  )
  # Transformer-only options back to their defaults (they would be ignored with a warning).
  c.model.update(d_ff=2048, num_heads=8, attention_dropout_rate=0.0)
  c.data.update(source_lang="de", target_lang="en", tokens_per_batch=2048)
  c.optim.update(schedule="constant", learning_rate=1e-3, warmup_steps=100, clip_norm=1.0)
  c.eval_every_steps = 250
  return c
