"""Continuous batching: a list (or stream) of sentences translated through a fixed pool of
decoding rows (model/pool.py), each sentence entering as soon as one leaves, instead of batches
decoded until their longest sentence ends.

    outputs = translate_continuous(model, params, sentences, pool_size=32, beam_size=4)
    for done in decode_continuous(model, params, sentences, source_len=64, beam_size=4):
      done.index, done.ids, done.scores   # in the order they finish: [beam, length], [beam]

One program is compiled per (model, pool size, search settings, source width): the sources are
padded to one width for the whole list (by default the `model.batching.bucket_length` of the
longest) and every sentence keeps its own length limit (its source tokens + `max_extra_len`, EOS
included). Each sentence's translation is the one the batch-at-once search of model/generate.py
gives it; a sampled sentence draws its noise from `rng` and its own index, whatever the pool or
its neighbours. Each device call runs many decoder steps and places sentences itself; the host
only hands it the next `queue_size` waiting sentences and collects the finished ones.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

import jax
import numpy as np

from model import pool as pool_lib
from model.batching import bucket_length
from model.generate import strip
from model.search_settings import FIELDS, SearchSettings
from model.special_tokens import EOS_ID

_ALL_STEPS = 2**31 - 1


class Hypotheses(NamedTuple):
  """One finished sentence: its `index` in the input, `ids` [beam, max_decode_len] its
  hypotheses (tokens up to EOS, then PAD) and `scores` [beam] their scores, best first (see
  `model.pool.Finished`)."""

  index: int
  ids: np.ndarray
  scores: np.ndarray


@functools.lru_cache(maxsize=8)
def _programs(spec: pool_lib.PoolSpec):
  """The jitted `model.pool.empty_pool` and `model.pool.advance` of one spec, kept while among
  the 8 most recently used."""
  return (
    jax.jit(functools.partial(pool_lib.empty_pool, spec)),
    jax.jit(functools.partial(pool_lib.advance, spec)),
  )


def pool_spec(
  model,
  settings: SearchSettings | None = None,
  *,
  source_len: int,
  pool_size: int = 32,
  queue_size: int | None = None,
  ensemble: bool = False,
  num_ids: int | None = None,
  **fields,
) -> pool_lib.PoolSpec:
  """The checked `PoolSpec`: `settings` (default `SearchSettings()`) with `fields` of it given
  as keywords replaced (beam_size=..., alpha=..., length_penalty=..., temperature=..., top_k=...,
  max_extra_len=...), as `settings.program()` (settings searching alike share one program);
  `queue_size` default `pool_size`; `num_ids` at or above the model's vocabulary masks nothing.
  """
  unknown = sorted(set(fields) - set(FIELDS))
  if unknown:
    raise ValueError(f"{unknown[0]}=...: not a setting; the settings are {', '.join(FIELDS)}")
  settings = SearchSettings(**fields) if settings is None else settings.replace(**fields)
  for name, value in (("source_len", source_len), ("pool_size", pool_size)):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f"{name}={value!r}: must be a positive integer")
  if queue_size is not None and (not isinstance(queue_size, (int, np.integer)) or queue_size < 1):
    raise ValueError(f"queue_size={queue_size!r}: must be a positive integer or None")
  if num_ids is not None and not EOS_ID < num_ids:
    raise ValueError(f"num_ids={num_ids!r}: must exceed the EOS id {EOS_ID}")
  return pool_lib.PoolSpec(
    model,
    settings.program().replace(num_hypotheses=1),  # the pool returns every hypothesis
    pool_size=int(pool_size),
    source_len=int(source_len),
    queue_size=int(queue_size or pool_size),
    num_ids=None if num_ids is None or num_ids >= model.config.vocab_size else int(num_ids),
    ensemble=bool(ensemble),
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
    **options: `pool_spec`'s: pool_size, queue_size, ensemble, num_ids, and the settings' fields
      as keywords.
  """
  spec = pool_spec(model, settings, source_len=source_len, **options)
  if max_steps is not None and (not isinstance(max_steps, (int, np.integer)) or max_steps < 1):
    raise ValueError(f"max_steps={max_steps!r}: must be a positive integer or None")
  steps = np.int32(_ALL_STEPS if max_steps is None else max_steps)
  return _decode(spec, params, sentences, jax.random.key(0) if rng is None else rng, steps)


def _decode(spec: pool_lib.PoolSpec, params, sentences, rng, steps) -> Iterator[Hypotheses]:
  """`decode_continuous`'s loop, its arguments checked: each call hands the device the next
  waiting sentences (`drain` once they are the last) and yields those it finished."""
  source_len = spec.source_len
  empty, advance = _programs(spec)
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
        waiting.append((item[0], _checked(item[1], item[0], source_len)))
    if exhausted and not waiting and not in_pool:
      return
    queue = np.zeros((spec.queue_size, source_len), np.int32)
    index = np.full((spec.queue_size,), -1, np.int32)
    count = min(len(waiting), spec.queue_size)
    for row in range(count):
      index[row], tokens = waiting[row]
      queue[row, : len(tokens)] = tokens
    drain = np.bool_(exhausted and len(waiting) <= spec.queue_size)
    pool = empty(params) if pool is None else pool
    pool, out, taken = advance(params, pool, queue, index, np.int32(count), rng, steps, drain)
    for _ in range(int(taken)):
      waiting.popleft()
    done = int(out.count)
    in_pool += int(taken) - done
    found, ids, scores = (np.asarray(x)[:done] for x in (out.index, out.ids, out.scores))
    for i in range(done):
      yield Hypotheses(int(found[i]), ids[i], scores[i])


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
  (no EOS, no PAD), as `model.generate.translate_all` returns them.

  Args:
    sentences: source ids of each sentence, each ending in EOS.
    settings: how to search (default `SearchSettings()`; its fields may be given as keywords).
    source_len: the padded source width; default `bucket_length` of the longest sentence.
    **options: `decode_continuous`'s (rng, max_steps, pool_size, queue_size, ensemble, num_ids)
      and the settings' fields (beam_size, alpha, length_penalty, temperature, top_k,
      max_extra_len).
  """
  sentences = list(sentences)
  if source_len is None:
    source_len = bucket_length(max((len(s) for s in sentences), default=1))
  outputs: list[np.ndarray | None] = [None] * len(sentences)
  found = decode_continuous(model, params, sentences, settings, source_len=source_len, **options)
  for done in found:
    outputs[done.index] = strip(done.ids[0])
  return outputs
