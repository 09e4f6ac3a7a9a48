"""Scoring given translations (forced decoding) for reranking and corpus filtering: each pair's
log-probability under the model and its target tokens' log-probabilities, as CTranslate2's
`score_batch` and fairseq's `--score-reference` give them.

    scorer = PairScorer(model, params, vocab, max_len=config.model.max_len)
    for pair in scorer.score(sources, targets):
      pair.log_prob, pair.token_log_probs, pair.tokens      # tokens end with '</s>' (EOS)

Both sides are tokenized as translation tokenizes a source (`data.tokenizer.encode_source`: the
pieces, then EOS; but a line over `max_len` tokens is refused, not cut: a cut pair would score
other sentences), pairs of similar lengths are padded to coarse length buckets and scored
together (one compiled program per (source bucket, target bucket, rows), a handful for a file;
`model/length_buckets.py`), and the results come back in input order. The numbers are
`model.forced_scoring.score`'s: by default the distribution the training loss reads (a pair's
log-probability is minus its unsmoothed cross entropy), with `as_search=True` the one the
searches draw from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np

from core.errors import ArgumentError, UsageError
from data.tokenizer import Vocab, encode_source
from model import distribution, forced_scoring
from model.length_buckets import bucket_length, length_batches


@dataclasses.dataclass(frozen=True)
class PairScore:
  """One pair's score.

  Attributes:
    log_prob: the target's log-probability given the source, EOS included (natural log).
    token_log_probs: [tokens] float32, each target token's log-probability; they sum to log_prob.
    tokens: the target's pieces, ending with the EOS piece ('</s>'), one per log-probability.
    ids: the target's ids, ending with EOS.
  """

  log_prob: float
  token_log_probs: np.ndarray
  tokens: list[str]
  ids: list[int]

  @property
  def mean_log_prob(self) -> float:
    """log_prob per target token (EOS counted), the length-normalised score."""
    return self.log_prob / len(self.ids)


class PairScorer:
  """A model ready to score sentence pairs; it owns its compiled programs (one per batch shape
  and `as_search`), so later calls with the same shapes compile nothing.

  Args:
    model: from `model.build.build_model`; params: its parameters (with `ensemble`, the
      members' stacked on a leading axis, as `inference.restore` gives an 'ensemble:k').
    vocab: the model's vocabulary (`data.tokenizer.Vocab`).
    max_len: the longest sentence, in tokens with EOS, of either side (`config.model.max_len`).
    batch_multiple: every batch's row count is a multiple of this (the devices it is split over).
    place: applied to each batch's [rows, length] source and target ids before scoring (e.g.
      `jax.device_put` with a sharding); None leaves them as numpy.
  """

  def __init__(
    self,
    model,
    params,
    vocab: Vocab,
    *,
    max_len: int,
    ensemble: bool = False,
    batch_multiple: int = 1,
    place: Callable | None = None,
  ):
    if max_len < 2:
      raise ArgumentError("max_len", max_len, "must be at least 2 (a token and EOS)")
    if batch_multiple < 1:
      raise ArgumentError("batch_multiple", batch_multiple, "must be positive")
    self.model, self.params, self.vocab = model, params, vocab
    self.max_len, self.ensemble = int(max_len), bool(ensemble)
    self.batch_multiple, self.place = int(batch_multiple), place
    num_ids = distribution.useful_num_ids(vocab.vocab_size, model.config.vocab_size)

    def score_batch(params, inputs, targets, as_search):
      return forced_scoring.score(
        model,
        params,
        inputs,
        targets,
        ensemble=self.ensemble,
        as_search=as_search,
        num_ids=num_ids if as_search else None,
      )

    self._score_batch = jax.jit(score_batch, static_argnames="as_search")

  def encode(self, sentences: Sequence[str], name: str) -> list[list[int]]:
    """The ids + EOS of each sentence of the argument `name` ('sources' or 'targets'); a
    UsageError naming the line for an empty target or a line over `max_len`."""
    if isinstance(sentences, str):
      raise UsageError(f"{name}: expected a list of sentences, got one string")
    ids = []
    for index, sentence in enumerate(sentences):
      text = sentence.strip()
      if not text and name == "targets":
        raise UsageError(f"{name}[{index}] is empty: every pair needs a target to score")
      target = name == "targets"
      tokens, cut = encode_source(self.vocab, text, self.max_len, target=target)
      if cut:
        encode = self.vocab.encode_target if target else self.vocab.encode
        raise UsageError(
          f"{name}[{index}] has {len(encode(text)) + 1} tokens with EOS, more than "
          f"the model takes (max_len={self.max_len})"
        )
      ids.append(tokens)
    return ids

  def score(
    self,
    sources: Sequence[str],
    targets: Sequence[str],
    *,
    tokens_per_batch: int = 4096,
    as_search: bool = False,
  ) -> list[PairScore]:
    """The score of each pair (`sources[i]`, `targets[i]`), in input order.

    An empty source is read as EOS alone; an empty target, a line longer than `max_len` tokens
    (EOS included) or lists of different lengths are a UsageError (a ValueError) naming the
    argument, raised before any scoring. `tokens_per_batch`: padded source plus target tokens
    per batch. `as_search`: the distribution of the searches rather than of the training loss
    (`model.forced_scoring`)."""
    source_ids = self.encode(sources, "sources")
    target_ids = self.encode(targets, "targets")
    if len(source_ids) != len(target_ids):
      raise UsageError(
        f"targets: {len(target_ids)} sentences for {len(source_ids)} sources; they pair up "
        f"line for line"
      )
    return self.score_ids(
      source_ids, target_ids, tokens_per_batch=tokens_per_batch, as_search=as_search
    )

  def score_ids(
    self,
    source_ids: Sequence[Sequence[int]],
    target_ids: Sequence[Sequence[int]],
    *,
    tokens_per_batch: int = 4096,
    as_search: bool = False,
  ) -> list[PairScore]:
    """`score` of pairs already tokenized: each side's ids ending in EOS (e.g. a search's
    hypotheses with EOS appended), at most `max_len` of them."""
    if int(tokens_per_batch) < 1:
      raise ArgumentError("tokens_per_batch", tokens_per_batch, "must be positive")
    results: list[PairScore | None] = [None] * len(source_ids)
    for indices, inputs, outputs in pair_batches(
      source_ids, target_ids, int(tokens_per_batch), self.batch_multiple
    ):
      if self.place is not None:
        inputs, outputs = self.place(inputs), self.place(outputs)
      token_logp, _ = self._score_batch(self.params, inputs, outputs, bool(as_search))
      token_logp = np.asarray(token_logp)
      for row, i in enumerate(indices):
        ids = target_ids[i]
        logp = token_logp[row, : len(ids)]
        results[i] = PairScore(
          log_prob=float(np.sum(logp, dtype=np.float64)),
          token_log_probs=logp,
          tokens=[self.vocab.piece(t) or "" for t in ids],
          ids=list(ids),
        )
    return results


def pair_batches(
  source_ids: Sequence[Sequence[int]],
  target_ids: Sequence[Sequence[int]],
  tokens_per_batch: int,
  batch_multiple: int = 1,
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
  """Pairs in few batch shapes: grouped by (`bucket_length` of the source, of the target), each
  group cut by `model.length_buckets.length_batches` into batches of one row count, with
  `tokens_per_batch` counting source plus target bucket tokens per row. The last batch's spare
  rows repeat its last pair.

  Returns:
    (indices, inputs [rows, source bucket], targets [rows, target bucket]) per batch: row j <
    len(indices) holds pair indices[j], 0 on padding; every pair index appears once.
  """
  keys = np.array(
    [(bucket_length(len(s)), bucket_length(len(t))) for s, t in zip(source_ids, target_ids)],
    np.int64,
  ).reshape(-1, 2)
  batches = []
  for src_bucket, tgt_bucket in np.unique(keys, axis=0).tolist():
    members = np.flatnonzero((keys[:, 0] == src_bucket) & (keys[:, 1] == tgt_bucket))
    budget = max(1, tokens_per_batch * src_bucket // (src_bucket + tgt_bucket))  # source's share
    for batch in length_batches([source_ids[i] for i in members], budget, batch_multiple):
      indices = members[batch.indices]
      targets = np.zeros((len(batch.inputs), tgt_bucket), np.int32)
      for row, i in enumerate(indices):
        targets[row, : len(target_ids[i])] = target_ids[i]
      targets[len(indices) :] = targets[len(indices) - 1]
      batches.append((indices, batch.inputs, targets))
  return batches
