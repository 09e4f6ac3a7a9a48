"""Multi30k (29k image-caption pairs) English->German with a small Transformer: 3+3 layers,
d_model 256, d_ff 1024, 4 heads, a shared 8000-piece SentencePiece vocabulary, the paper's
inverse-square-root schedule at 4096 target tokens per step.

    python train.py --config=configs/multi30k.py --workdir=runs/m30k
    python decode.py --workdir=runs/m30k --split=test_2016_flickr --beam_size=5 --alpha=1.5 \
        --checkpoint=average:3

The corpus (https://github.com/multi30k/dataset, task 1: splits train, val, test_2016_flickr,
test_2017_flickr, test_2017_mscoco, test_2018_flickr) is fetched on first use from the repository
at a pinned commit, checked against known digests, into `~/.cache/attention-jax/multi30k`
(`$XDG_CACHE_HOME` if set; data/multi30k.py): nothing to download by hand. Without a network,
`python -m cli.fetch multi30k` fetches it beforehand where there is one;
`--config.data.url=<mirror>` fetches from a mirror, `--config.data.dir=<folder>` reads
`<folder>/<split>.<lang>[.gz]` files already on disk. Two hours on a 2-core x86-64 CPU (1,484
steps, 2026-11-29): test_2016_flickr 37.27 cased / 37.62 lowercased. The other Multi30k configs
start from this one; `configs/multi30k_transformer_ende.py` and `multi30k_transformer_tiny_ende.py`
replace its schedule with one sized for a two-hour CPU budget.
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
    name="multi30k",
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
