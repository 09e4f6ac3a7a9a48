"""Periodic evaluation: loss, token accuracy and perplexity over the eval split, and BLEU /
exact match of greedy translations of a sample of it."""

from __future__ import annotations

import math

import jax
import numpy as np

from data.tokenizer import encode_source
from training.translation_metrics import corpus_bleu


def loss_metrics(parallel, params, batches) -> dict:
  """Token-weighted loss, nll, accuracy and perplexity over `batches`."""
  total = {"loss": 0.0, "nll": 0.0, "correct": 0.0, "tokens": 0.0}
  for batch in batches:
    sums = jax.device_get(parallel.eval_step(params, batch))
    for k in total:
      total[k] += float(sums[k])
  n = max(total["tokens"], 1.0)
  return {
    "loss": total["loss"] / n,
    "nll": total["nll"] / n,
    "accuracy": total["correct"] / n,
    "perplexity": math.exp(min(total["nll"] / n, 50.0)),
    "eval_tokens": total["tokens"],
  }


def translation_search(model, vocab, *, max_extra_len: int, beam_size: int = 1):
  """The jitted search `translation_metrics` runs: `model.generate.generate` of `[batch,
  source_len]` ids to `[batch, source_len + max_extra_len]` (training may not import inference/,
  whose `Generator` adds program ownership and a program store to the same search). Build it once
  per run: each new one traces and compiles again."""
  from model.distribution import useful_num_ids
  from model.generate import generate
  from model.search_settings import SearchSettings

  settings = SearchSettings(beam_size=beam_size, max_extra_len=max_extra_len).program()
  num_ids = useful_num_ids(vocab.vocab_size, model.config.vocab_size)
  return jax.jit(
    lambda p, x: generate(
      model, p, x, jax.random.key(0), settings, x.shape[1] + max_extra_len, num_ids=num_ids
    )
  )


def translation_metrics(
  model,
  params,
  vocab,
  pairs,
  *,
  max_len: int,
  max_extra_len: int,
  beam_size: int = 1,
  tokens_per_batch: int = 4096,
  search=None,
) -> dict:
  """BLEU (cased, on detokenized text: training/translation_metrics.py) and exact match of
  translations of `pairs`, by `search` (`translation_search` of the same model and settings;
  None: a new one) over length batches."""
  from model.generate import strip
  from model.length_buckets import length_batches

  if not pairs:
    return {}
  sources, references = zip(*pairs)
  if search is None:
    search = translation_search(model, vocab, max_extra_len=max_extra_len, beam_size=beam_size)
  token_lists = [encode_source(vocab, s, max_len)[0] for s in sources]
  outputs = [None] * len(token_lists)
  for batch in length_batches(token_lists, tokens_per_batch):
    ids = np.asarray(search(params, batch.inputs))
    for row, i in enumerate(batch.indices):
      outputs[i] = strip(ids[row])
  hypotheses = [vocab.decode(o.tolist()) for o in outputs]
  exact = np.mean([h.strip() == r.strip() for h, r in zip(hypotheses, references)])
  return {"bleu": corpus_bleu(hypotheses, references), "exact_match": float(exact)}
