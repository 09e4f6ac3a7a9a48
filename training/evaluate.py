"""Periodic evaluation: loss, token accuracy and perplexity over the eval split, and BLEU /
exact match of greedy translations of a sample of it."""

from __future__ import annotations

import math

import jax
import numpy as np
import sacrebleu

from data.tokenizer import encode_source


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
) -> dict:
  """BLEU (sacreBLEU, cased, on detokenized text) and exact match of translations of `pairs`:
  `model.generate.generate` over length batches (training may not import inference/, whose
  `Generator` adds compiled-program ownership and a program store to the same loop)."""
  from model.batching import length_batches
  from model.distribution import useful_num_ids
  from model.generate import generate, strip
  from model.search_settings import SearchSettings

  if not pairs:
    return {}
  sources, references = zip(*pairs)
  settings = SearchSettings(beam_size=beam_size, max_extra_len=max_extra_len).program()
  num_ids = useful_num_ids(vocab.vocab_size, model.config.vocab_size)
  search = jax.jit(
    lambda p, x: generate(
      model, p, x, jax.random.key(0), settings, x.shape[1] + max_extra_len, num_ids=num_ids
    )
  )
  token_lists = [encode_source(vocab, s, max_len)[0] for s in sources]
  outputs = [None] * len(token_lists)
  for batch in length_batches(token_lists, tokens_per_batch):
    ids = np.asarray(search(params, batch.inputs))
    for row, i in enumerate(batch.indices):
      outputs[i] = strip(ids[row])
  hypotheses = [vocab.decode(o.tolist()) for o in outputs]
  bleu = sacrebleu.corpus_bleu(hypotheses, [list(references)])
  exact = np.mean([h.strip() == r.strip() for h, r in zip(hypotheses, references)])
  return {"bleu": bleu.score, "exact_match": float(exact)}
