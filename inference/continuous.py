"""Continuous batching: a list (or stream) of sentences translated through a fixed pool of
decoding rows (model/pool.py), each sentence entering as soon as one leaves, instead of batches
decoded until their longest sentence ends. This module is the host side: it reads the sentences,
hands the device the next waiting ones and collects the finished ones.

    outputs = translate_continuous(model, params, sentences, pool_size=32, beam_size=4)
    for done in decode_continuous(model, params, sentences, source_len=64, beam_size=4):
      done.index, done.ids, done.scores   # in the order they finish: [beam, length], [beam]
    programs = PoolPrograms()   # owns compiled pools: pass it to every call that should share
    decode_continuous(..., prefixes=prefix_lists)  # each output starts with its target prefix

One program is compiled per (model, pool size, search settings, source width) and kept by the
`PoolPrograms` passed as `programs` (without one, a call compiles its own): the sources are
padded to one width for the whole list (by default the `model.length_buckets.bucket_length` of the
longest) and every sentence keeps its own length limit (its source tokens + `max_extra_len`, EOS
included; with a target prefix, as model/generate.py says). Each sentence's translation is the
one the batch-at-once search of model/generate.py gives it; a sampled sentence draws its noise
from `rng` and its own index, whatever the pool or its neighbours. Each device call runs many
decoder steps and places sentences itself; the host only hands it the next `queue_size` waiting
sentences and collects the finished ones.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple

import jax
import numpy as np

from model import distribution
from model import pool as pool_lib
from model.generate import strip
from model.length_buckets import bucket_length, checked_prefixes, padded, prefix_width
from model.search_settings import FIELDS, SearchSettings, with_keywords

_ALL_STEPS = 2**31 - 1


class Hypotheses(NamedTuple):
  """One finished sentence: its `index` in the input, `ids` [beam, max_decode_len] its
  hypotheses (tokens up to EOS, then PAD) and `scores` [beam] their scores, best first (see
  `model.pool.Finished`); with `token_scores=True`, `token_scores` [beam, max_decode_len] their
  tokens' log-probabilities (0 after EOS), else None."""

  index: int
  ids: np.ndarray
  scores: np.ndarray
  token_scores: np.ndarray | None = None


class PoolPrograms:
  """The compiled pool programs of one owner (e.g. an `inference.Translator`): the jitted
  `model.pool.empty_pool` and `model.pool.advance` of each `PoolSpec` it was asked for, kept as
  long as it lives."""

  def __init__(self):
    self._programs: dict[pool_lib.PoolSpec, tuple[Callable, Callable]] = {}

  def __call__(self, spec: pool_lib.PoolSpec) -> tuple[Callable, Callable]:
    """(empty_pool, advance) of `spec`, compiled on first use."""
    if spec not in self._programs:
      self._programs[spec] = (
        jax.jit(functools.partial(pool_lib.empty_pool, spec)),
        jax.jit(functools.partial(pool_lib.advance, spec)),
      )
    return self._programs[spec]


def pool_spec(
  model,
  settings: SearchSettings | None = None,
  *,
  source_len: int,
  pool_size: int = 32,
  queue_size: int | None = None,
  ensemble: bool = False,
  num_ids: int | None = None,
  token_scores: bool = False,
  prefix_len: int = 0,
  **fields,
) -> pool_lib.PoolSpec:
  """The checked `PoolSpec`: `settings` (default `SearchSettings()`) with `fields` of it given
  as keywords replaced (beam_size=..., alpha=..., length_penalty=..., temperature=..., top_k=...,
  max_extra_len=...), as `settings.program()` (settings searching alike share one program);
  `queue_size` default `pool_size`; `num_ids` at or above the model's vocabulary masks nothing;
  `prefix_len` the width of the target prefixes (0: none).
  """
  settings, unknown = with_keywords(settings, fields)
  if unknown:
    name = sorted(unknown)[0]
    raise ValueError(f"{name}=...: not a setting; the settings are {', '.join(FIELDS)}")
  for name, value in (("source_len", source_len), ("pool_size", pool_size)):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f"{name}={value!r}: must be a positive integer")
  if queue_size is not None and (not isinstance(queue_size, (int, np.integer)) or queue_size < 1):
    raise ValueError(f"queue_size={queue_size!r}: must be a positive integer or None")
  if (
    isinstance(prefix_len, bool) or not isinstance(prefix_len, (int, np.integer)) or prefix_len < 0
  ):
    raise ValueError(f"prefix_len={prefix_len!r}: must be a non-negative integer")
  return pool_lib.PoolSpec(
    model,
    settings.program().replace(num_hypotheses=1),  # the pool returns every hypothesis
    pool_size=int(pool_size),
    source_len=int(source_len),
    queue_size=int(queue_size or pool_size),
    num_ids=distribution.useful_num_ids(num_ids, model.config.vocab_size),
    ensemble=bool(ensemble),
    token_scores=bool(token_scores),
    prefix_len=int(prefix_len),
  )


def decode_continuous(
  model,
  params,
  sentences: Iterable[Sequence[int]],
  settings: SearchSettings | None = None,
  *,
  source_len: int,
  rng=None,
  max_steps: int | None = None,
  programs: PoolPrograms | None = None,
  prefixes: Sequence[Sequence[int]] | None = None,
  **options,
) -> Iterator[Hypotheses]:
  """Translates `sentences` through a pool, yielding each as it finishes (`Hypotheses`, in
  finishing order, `index` giving its place in the input).

  Args:
    model: a module from `model.build.build_model`; params: its (unboxed) parameters, or with
      `ensemble=True` several members' stacked on a leading axis.
    sentences: source ids, each ending in EOS, at most `source_len` tokens; read lazily, at most
      `queue_size` sentences ahead of the pool.
    settings: how to search (default `SearchSettings()`).
    source_len: the padded source width (one program per width).
    rng: the sampling key (default `jax.random.key(0)`).
    max_steps: decoder steps per device call at most (None: as many as the queue needs).
    programs: where the compiled pool comes from and stays (None: compiled for this call).
    prefixes: a target prefix per sentence (ids, no EOS; empty: none), given as a list: each
      sentence's output starts with its prefix. None or all empty: decoded as without.
    **options: `pool_spec`'s: pool_size, queue_size, ensemble, num_ids, token_scores, and the
      settings' fields as keywords.
  """
  if prefixes is not None and not any(len(p) for p in prefixes):
    prefixes = None
  width = 0 if prefixes is None else prefix_width(prefixes)
  spec = pool_spec(model, settings, source_len=source_len, prefix_len=width, **options)
  if prefixes is not None:
    limit = spec.num_ids or model.config.vocab_size
    prefixes = checked_prefixes(padded(prefixes, width), len(prefixes), limit)
  if max_steps is not None and (not isinstance(max_steps, (int, np.integer)) or max_steps < 1):
    raise ValueError(f"max_steps={max_steps!r}: must be a positive integer or None")
  steps = np.int32(_ALL_STEPS if max_steps is None else max_steps)
  rng = jax.random.key(0) if rng is None else rng
  return _decode(spec, params, sentences, rng, steps, programs or PoolPrograms(), prefixes)


def _decode(spec, params, sentences, rng, steps, programs, prefixes) -> Iterator[Hypotheses]:
  """`decode_continuous`'s loop, its arguments checked: each call hands the device the next
  waiting sentences (`drain` once they are the last) and yields those it finished."""
  source_len = spec.source_len
  empty, advance = programs(spec)
  pool = None
  reader = enumerate(sentences)
  waiting: collections.deque = collections.deque()
  exhausted, in_pool = False, 0
  while True:
    while not exhausted and len(waiting) < spec.queue_size:
      item = next(reader, None)
      if item is None:
        exhausted = True
      else:
        if prefixes is not None and item[0] >= len(prefixes):
          raise ValueError(f"prefixes: {len(prefixes)} given, fewer than the sentences")
        waiting.append((item[0], _checked(item[1], item[0], source_len)))
    if exhausted and not waiting and not in_pool:
      return
    queue = np.zeros((spec.queue_size, source_len), np.int32)
    index = np.full((spec.queue_size,), -1, np.int32)
    count = min(len(waiting), spec.queue_size)
    for row in range(count):
      index[row], tokens = waiting[row]
      queue[row, : len(tokens)] = tokens
    queue_prefix = None
    if prefixes is not None:
      queue_prefix = np.zeros((spec.queue_size, spec.prefix_len), np.int32)
      queue_prefix[:count] = prefixes[index[:count]]
    drain = np.bool_(exhausted and len(waiting) <= spec.queue_size)
    pool = empty(params) if pool is None else pool
    pool, out, taken = advance(
      params, pool, queue, index, np.int32(count), rng, steps, drain, queue_prefix
    )
    for _ in range(int(taken)):
      waiting.popleft()
    done = int(out.count)
    in_pool += int(taken) - done
    found, ids, scores = (np.asarray(x)[:done] for x in (out.index, out.ids, out.scores))
    tokens = None if out.token_scores is None else np.asarray(out.token_scores)[:done]
    for i in range(done):
      yield Hypotheses(int(found[i]), ids[i], scores[i], None if tokens is None else tokens[i])


def _checked(tokens, index: int, source_len: int) -> np.ndarray:
  tokens = np.asarray(tokens, np.int32).reshape(-1)
  if len(tokens) > source_len:
    raise ValueError(f"sentences[{index}]: {len(tokens)} tokens, more than source_len={source_len}")
  return tokens


def translate_continuous(
  model,
  params,
  sentences: Sequence[Sequence[int]],
  settings: SearchSettings | None = None,
  *,
  source_len: int | None = None,
  **options,
) -> list[np.ndarray]:
  """`decode_continuous` over a list: per sentence, in input order, its best translation's ids
  (no EOS, no PAD), as `inference.generator.translate_all` returns them.

  Args:
    sentences: source ids of each sentence, each ending in EOS.
    settings: how to search (default `SearchSettings()`; its fields may be given as keywords).
    source_len: the padded source width; default `bucket_length` of the longest sentence.
    **options: `decode_continuous`'s (rng, max_steps, programs, prefixes, pool_size, queue_size,
      ensemble, num_ids)
      and the settings' fields (beam_size, alpha, length_penalty, temperature, top_k,
      max_extra_len).
  """
  sentences = list(sentences)
  prefixes = options.get("prefixes")
  if prefixes is not None and len(prefixes) != len(sentences):
    raise ValueError(f"prefixes: {len(prefixes)} given for {len(sentences)} sentences")
  if source_len is None:
    source_len = bucket_length(max((len(s) for s in sentences), default=1))
  outputs: list[np.ndarray | None] = [None] * len(sentences)
  found = decode_continuous(model, params, sentences, settings, source_len=source_len, **options)
  for done in found:
    outputs[done.index] = strip(done.ids[0])
  return outputs
