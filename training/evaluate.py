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
  """BLEU (sacreBLEU, cased, on detokenized text) and exact match of translations of `pairs`."""
  from inference.generator import translate_all

  if not pairs:
    return {}
  sources, references = zip(*pairs)
  outputs = translate_all(
    model,
    params,
    [encode_source(vocab, s, max_len)[0] for s in sources],
    tokens_per_batch=tokens_per_batch,
    beam_size=beam_size,
    max_extra_len=max_extra_len,
    num_ids=vocab.vocab_size,
  )
  hypotheses = [vocab.decode(o.tolist()) for o in outputs]
  bleu = sacrebleu.corpus_bleu(hypotheses, [list(references)])
  exact = np.mean([h.strip() == r.strip() for h, r in zip(hypotheses, references)])
  return {"bleu": bleu.score, "exact_match": float(exact)}
