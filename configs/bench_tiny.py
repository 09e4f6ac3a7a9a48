"""The benchmark targets' "tiny" Transformer: d_model 256, d_ff 1024, 4 heads, 3+3 layers, a
shared 8000-word vocabulary, float32, no dropout; bench batches of 16 × 64 tokens.

    python bench.py --config=configs/bench_tiny.py                     # train step, MFU
    python bench.py --config=configs/bench_tiny.py --mode=decode \
        --config.bench.batch_size=32 --config.bench.seq_len=32        # 48 tokens, beam 4

Its step time, MFU and decoding speed: docs/results.md, "Step time, MFU and decoding".
"""

from configs import common


def get_config():
  c = common.base_config()
  c.model.update(
    vocab_size=8000,
    d_model=256,
    d_ff=1024,
    num_heads=4,
    num_layers=3,
    dropout_rate=0.0,
    max_len=256,
  )
  c.bench.update(batch_size=16, seq_len=64, decode_len=48, beam_size=4)
  return c
