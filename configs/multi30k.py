"""Multi30k (29k image-caption pairs) English->German with a small Transformer: 3+3 layers,
d_model 256, d_ff 1024, 4 heads, a shared 8000-piece SentencePiece vocabulary.

    python train.py --config=configs/multi30k.py --workdir=runs/m30k \
        --config.data.dir=../shared/data/multi30k

The corpus is read from `<data.dir>/{train,val,test_2016_flickr}.{en,de}[.gz]`
(https://github.com/multi30k/dataset, task 1). `configs/multi30k_transformer_ende.py` is
this model with a recipe sized for a 2-hour CPU budget; the README's en->de row,
`configs/multi30k_transformer_tiny_ende.py`, is that recipe on Transformer-tiny.
"""

from configs import common


def get_config():
  c = common.base_config()
  c.model.update(
    d_model=256,
    d_ff=1024,
    num_heads=4,
    num_layers=3,
    dropout_rate=0.1,
    attention_dropout_rate=0.1,
    max_len=128,
  )
  c.data.update(
    name="files",
    dir="../shared/data/multi30k",
    source_lang="en",
    target_lang="de",
    train_split="train",
    eval_split="val",
    vocab_size=8000,
    tokens_per_batch=4096,
    max_len=64,
  )
  c.optim.update(warmup_steps=800, learning_rate=1.0, label_smoothing=0.1)
  c.num_train_steps = 20_000
  c.log_every_steps = 50
  c.eval_every_steps = 500
  c.checkpoint_every_steps = 250
  c.checkpoint.keep = 10
  c.eval.bleu_sentences = 256
  return c
