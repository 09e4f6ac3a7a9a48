"""The data pipeline the training code calls: corpus -> vocabulary -> cached token ids -> batches.

pipeline = data.pipeline.build(config, workdir, batch_multiple=n_devices * accum_steps,
                               process_index=jax.process_index(), process_count=jax.process_count())
it = pipeline.train_iter()  # endless; it.state() goes in checkpoints, it.restore(state) resumes
for batch in pipeline.eval_batches(): ...
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterator

import numpy as np
from absl import logging

from data import sources, token_cache, tokenizer
from data.batching import Batcher, TrainIterator


def _vocab(config_data, workdir: pathlib.Path) -> tokenizer.Vocab:
  if config_data.name != sources.SYNTHETIC:

    def texts() -> Iterator[str]:
      for src, tgt in sources.iter_split(config_data, config_data.train_split):
        yield src
        yield tgt

    return tokenizer.load_or_train_vocab(config_data, workdir, texts)
  if config_data.vocab_path:
    return tokenizer.load_vocab(config_data.vocab_path)
  path = workdir / tokenizer.VOCAB_JSON_NAME
  words = sources.synthetic_words(config_data.synthetic_vocab)
  if path.exists():
    vocab = tokenizer.load_vocab(path)
    if getattr(vocab, "words", None) != list(words):
      raise ValueError(
        f"{path} holds another synthetic vocabulary ({vocab.vocab_size} ids) than "
        f"data.synthetic_vocab={config_data.synthetic_vocab} makes: use a new workdir "
        f"(or the old setting to continue with this one)"
      )
    return vocab
  vocab = tokenizer.WordVocab(words)
  vocab.save(path)
  return vocab


# A split losing more than this share of its pairs (dropped or cut) gets a warning.
LOSS_WARNING_SHARE = 0.01


def warn_about_losses(name: str, stats: dict, max_len: int) -> None:
  """Warns when more than LOSS_WARNING_SHARE of a split's pairs were dropped as too long, skipped
  as empty, or cut to max_len: the count, the share and the setting to change."""
  total = stats.get("pairs", 0) + stats.get("skipped_empty", 0)
  if not total:
    return
  losses = (
    (
      stats.get("filtered_long", 0),
      f"were dropped as longer than data.max_len={max_len} tokens "
      "(raise data.max_len, or set data.truncate=True to cut them instead)",
    ),
    (
      stats.get("truncated_long", 0),
      f"were cut to data.max_len={max_len} tokens (raise data.max_len to keep them whole)",
    ),
    (
      stats.get("skipped_empty", 0),
      "were skipped because a side is empty (check the files' line alignment)",
    ),
  )
  for count, what in losses:
    if count / total > LOSS_WARNING_SHARE:
      logging.warning(
        "data %s: %d of %d pairs (%.1f%%) %s", name, count, total, 100.0 * count / total, what
      )


class Pipeline:
  """Vocabulary, batches and raw text of one corpus; made by `build`.

  Attributes:
    vocab: the shared source/target vocabulary.
    stats: per split name, counts: `pairs` read, `skipped_empty` pairs, `filtered_long` or
      `truncated_long` examples (longer than `max_len`), `examples` kept, `source_tokens`,
      `target_tokens`.
  """

  def __init__(
    self,
    config,
    workdir: str | os.PathLike,
    vocab: tokenizer.Vocab,
    *,
    batch_multiple: int,
    process_index: int,
    process_count: int,
  ):
    self.config, self.vocab = config, vocab
    data = config.data
    self._cache_dir = pathlib.Path(data.cache_dir or pathlib.Path(workdir) / "cache")
    self._batcher_args = dict(
      tokens_per_batch=data.tokens_per_batch,
      max_len=data.max_len,
      packing=data.packing,
      batch_multiple=batch_multiple,
      process_index=process_index,
      process_count=process_count,
      seed=config.get("seed", 0),
    )
    self._batchers: dict[str, Batcher] = {}
    self.stats: dict[str, dict] = {}

  def batcher(self, split: str) -> Batcher:
    """The batcher of `split`, tokenizing and caching the split on first use."""
    if split not in self._batchers:
      data = self.config.data
      tokens = token_cache.load_or_tokenize(
        self._cache_dir,
        split,
        sources.corpus_identity(data, split),
        self.vocab,
        lambda stats: sources.iter_split(data, split, stats),
        max_len=data.max_len,
        truncate=data.truncate,
      )
      self.stats[split] = dict(tokens.stats)
      logging.info(
        "data %s/%s: %s", data.name, split, ", ".join(f"{k}={v}" for k, v in tokens.stats.items())
      )
      warn_about_losses(f"{data.name}/{split}", tokens.stats, data.max_len)
      self._batchers[split] = Batcher(tokens, **self._batcher_args)
    return self._batchers[split]

  @property
  def batch_shapes(self) -> list[tuple[int, int]]:
    """`(rows, length)` of the training batches this process can receive (one per compilation)."""
    return self.batcher(self.config.data.train_split).batch_shapes

  def train_iter(self) -> TrainIterator:
    """Endless training batches from the start; `.state()` / `.restore(state)` to resume."""
    return self.batcher(self.config.data.train_split).train_iter()

  def eval_batches(self, split: str | None = None) -> list[dict[str, np.ndarray]]:
    """Every example of `split` (default `data.eval_split`) once, in batches of one shape; the last
    batch is filled with all-padding rows (segmentation 0)."""
    return list(self.batcher(split or self.config.data.eval_split).eval_batches())

  def pairs(self, split: str | None = None) -> list[sources.Pair]:
    """Raw `(source_text, target_text)` pairs of `split` (default `data.eval_split`), all of them,
    stripped, empty pairs skipped, none filtered by length: for BLEU and decoding."""
    return sources.load_split(self.config.data, split or self.config.data.eval_split)[0]


def build(
  config,
  workdir: str | os.PathLike,
  *,
  batch_multiple: int = 1,
  process_index: int = 0,
  process_count: int = 1,
) -> Pipeline:
  """Loads (or trains) the vocabulary and tokenizes (or reads cached) train and eval splits.

  Args:
    config: ConfigDict with `data` (the fields of configs/common.py) and top-level `seed`.
    workdir: run folder; holds `vocab.model`/`vocab.json` and, by default, the token-id cache.
    batch_multiple: GLOBAL row multiple: data-parallel devices over all processes x
      gradient-accumulation micro-batches. Every global batch's row count is a multiple of
      `lcm(batch_multiple, process_count)`; this process receives `rows / process_count` rows.
    process_index, process_count: this process (e.g. `jax.process_index()`) and the process count.

  Errors in the corpus (missing files, unequal line counts, bad UTF-8, unknown TFDS name) are raised
  here, before any training.
  """
  workdir = pathlib.Path(workdir)
  vocab = _vocab(config.data, workdir)
  logging.info("vocabulary: %d ids (%s)", vocab.vocab_size, vocab.fingerprint)
  pipeline = Pipeline(
    config,
    workdir,
    vocab,
    batch_multiple=batch_multiple,
    process_index=process_index,
    process_count=process_count,
  )
  for split in (config.data.train_split, config.data.eval_split):
    pipeline.batcher(split)
  return pipeline
