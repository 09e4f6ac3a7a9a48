"""Every configuration field, with its default. Config files start from `base_config()` and change
what differs; any field can be overridden on the command line (`--config.model.num_layers=2`), and
a field that is not here is an error."""

from __future__ import annotations

import ml_collections

from data.pipeline import default_data_config


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()

  c.seed = 0
  c.num_train_steps = 100_000
  c.log_every_steps = 100
  c.eval_every_steps = 1_000
  c.checkpoint_every_steps = 1_000
  # After SIGTERM/SIGINT the loop saves and exits; if it is still running this many seconds later
  # (hung), the process exits with status 128 + signal without a new save. 0 = wait forever.
  c.stop_timeout_s = 600.0
  # 'pmap' (data parallel, replicated state) or 'mesh' (jit over a Mesh with sharded state).
  c.parallelism = "mesh"
  c.num_devices = 0  # use the first N devices of each process; 0 = all
  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))

  # Model: the paper's names. num_layers is per stack; vocab_size 0 = the vocabulary's size.
  c.model = ml_collections.ConfigDict(
    dict(
      type="transformer",
      vocab_size=0,
      d_model=512,
      d_ff=2048,
      num_heads=8,
      num_layers=6,
      dropout_rate=0.1,
      attention_dropout_rate=0.0,
      share_embeddings=True,
      max_len=256,
      pre_ln=False,
      dtype="float32",
      remat=False,
      attention_impl="xla",
      # Recurrent models (model.type rnn / rnn_attention) only.
      rnn_cell="gru",
      rnn_bidirectional=True,
    )
  )

  # Data: 'synthetic' (built in), 'files' (<dir>/<split>.<lang>[.gz]) or a TFDS name; the fields
  # and their meaning are in data/pipeline.py.
  c.data = default_data_config()

  # Optimization: Adam with the paper's inverse-square-root schedule.
  c.optim = ml_collections.ConfigDict(
    dict(
      schedule="rsqrt",  # rsqrt (the paper's) | constant | cosine
      learning_rate=1.0,  # multiplies the schedule (rsqrt) or is the peak rate (others)
      warmup_steps=4000,
      b1=0.9,
      b2=0.98,
      eps=1e-9,
      weight_decay=0.0,
      clip_norm=0.0,  # global-norm clipping; 0 = off
      label_smoothing=0.1,
      grad_accum_steps=1,
      max_nonfinite_steps=10,
    )
  )

  c.eval = ml_collections.ConfigDict(
    dict(
      num_batches=0,  # 0 = the whole eval split
      bleu_sentences=256,  # sentences decoded greedily for BLEU at each evaluation
      max_decode_extra=50,  # output length limit = source length + this
    )
  )

  c.checkpoint = ml_collections.ConfigDict(
    dict(
      keep=5,
      keep_best=0,  # also keep the N best by eval BLEU; 0 = off
      async_save=True,
    )
  )

  c.bench = ml_collections.ConfigDict(
    dict(
      batch_size=16,
      seq_len=64,
      decode_len=48,
      beam_size=4,
    )
  )
  return c
