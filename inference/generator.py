"""Translating token ids with a trained model: a `Generator` compiles the search of
`model.generate` and owns its programs; it decodes one batch, or any number of sentences in
length batches.

    generator = Generator(model, num_ids=vocab_size)      # owns its compiled programs
    ids = generator(params, inputs, SearchSettings(beam_size=4))  # [batch, max_decode_len]
    outs = generator.translate_all(params, token_lists, settings)  # input order
    outs = generator.translate_all(params, token_lists, settings, prefixes=prefix_lists)
    ids = translate(model, params, inputs, beam_size=4)   # a one-off: compiles on every call

A `Generator` compiles each distinct (input shape, search settings, outputs) once and keeps the
programs while it lives; `translate` and `translate_all` make a generator for one call, so
repeated calls should hold a `Generator` instead.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from model import distribution
from model.decoder_state import DECODE_SEGMENT
from model.generate import OUTPUTS, generate, nbest, strip
from model.length_buckets import checked_prefixes, length_batches
from model.search_settings import SearchSettings, with_keywords


class Generator:
  """The compiled searches of one model: `generator(params, inputs, settings)` searches, and
  `translate_all` decodes any number of sentences in length batches.

  One program is compiled per distinct (settings.program(), input shape, max_decode_len, and
  whether scores are returned) and kept as long as the generator lives (its `jax.jit`'s cache),
  parameters being an argument, never constants baked in. `inference.Translator` owns one;
  `translate` below makes one per call.

  Args:
    model: a module from `model.build.build_model`.
    num_ids: only ids below this are emitted (pass the vocabulary's size: when the model's
      vocab_size is larger, the extra output rows have no piece to decode to); None = every id.
    ensemble: the params are several members' parameter trees stacked on a leading axis (same
      architecture), decoded as one model by the mean of their next-token probabilities
      (`ensemble_decoder_state`); an ensemble needs `use_cache`.
    use_cache: False re-runs the full model on the prefix every step (same output, slower).
    segment: self-attention caches start at this many positions and grow, doubling (None:
      allocate `max_decode_len` at once); same output, faster for long outputs
      (`decoder_state`).
    programs: where compiled programs come from instead of the `jax.jit` (e.g.
      `inference.program_store.ProgramStore`, which keeps them on disk between runs): called as
      `programs(signature, lower, device)` with a string naming everything the program depends on
      in this model and call, a function returning its `jax.stages.Lowered`, and the one device
      it runs on; returns the compiled program, called with (params, inputs, rng). Arguments
      spread over several devices are decoded by the `jax.jit` as without.
  """

  def __init__(
    self,
    model,
    *,
    num_ids: int | None = None,
    ensemble: bool = False,
    use_cache: bool = True,
    segment: int | None = DECODE_SEGMENT,
    programs: Callable | None = None,
  ):
    num_ids = distribution.useful_num_ids(num_ids, model.config.vocab_size)
    if segment is not None and segment < 1:
      raise ValueError(f"segment={segment!r}: must be positive or None")
    if ensemble and not use_cache:
      raise ValueError(
        "use_cache=False: an ensemble decodes with the key/value cache; use_cache=False is for "
        "single models"
      )
    self.model = model
    self.num_ids = num_ids
    self.ensemble, self.use_cache, self.segment = ensemble, use_cache, segment
    self._run = jax.jit(self._search, static_argnums=(4, 5, 6))
    self._lower = jax.jit(self._kept_search, static_argnums=(4, 5, 6)).lower
    self._programs = programs
    self._compiled: dict[tuple, Callable | None] = {}  # by arguments' shapes and shardings
    # The last translate_all's (rows x steps searched, rows x steps its sentences needed: each
    # sentence's rows times the steps it searched before it was done); (0, 0) for Marian's.
    self.rows_searched = (0, 0)

  def __call__(
    self,
    params,
    inputs,
    settings: SearchSettings,
    *,
    rng=None,
    max_decode_len=None,
    scores: bool = False,
    token_scores: bool = False,
    prefix=None,
  ):
    """Best translation of each source row.

    Args:
      params: the model's (unboxed) parameters (stacked members' for an ensemble).
      inputs: [batch, src_len] source ids ending in EOS, 0 on padding.
      settings: how to search; rng (default `jax.random.key(0)`) draws the samples.
      max_decode_len: static output width; default src_len + settings.max_extra_len (with a
        prefix, max(src_len, P) + max_extra_len). Rows reaching it stop without EOS.
      scores, token_scores: also return the search's scores (and each token's log-probability).
      prefix: None, or [batch, P] target prefixes, each row's ids (above EOS, below `num_ids`)
        then PAD, P more than the longest: each row's outputs start with its prefix
        (`model.generate.generate`).

    Returns:
      ids [batch, max_decode_len] int32: tokens up to EOS, then PAD; with
      `settings.num_hypotheses` n > 1, beam search's n best [batch, n, max_decode_len], best
      first. With `scores`: (ids, scores [batch] or [batch, n] float32 (`NBest.scores`)), and
      with `token_scores` a third array shaped as ids, float32: each token's log-probability
      (a forced EOS 0; 0 after EOS).
    """
    return self._counted(
      params, inputs, settings, rng, max_decode_len, scores, token_scores, prefix
    )[0]

  def _counted(
    self, params, inputs, settings, rng, max_decode_len, scores, token_scores, prefix
  ) -> tuple:
    """(`__call__`'s result, [batch] int32 the steps each row searched before it was done, or
    None for Marian's search)."""
    if not isinstance(settings, SearchSettings):
      raise ValueError(f"settings={settings!r}: expected a SearchSettings")
    if getattr(inputs, "ndim", None) != 2:
      inputs = np.asarray(inputs)
    if inputs.ndim != 2:
      raise ValueError(f"inputs: must be [batch, src_len] ids, got shape {inputs.shape}")
    if prefix is not None:
      limit = self.num_ids or self.model.config.vocab_size
      prefix = checked_prefixes(prefix, inputs.shape[0], limit)
    if max_decode_len is None:
      max_decode_len = _width(inputs, prefix) + settings.max_extra_len
    if max_decode_len < 1:
      raise ValueError(f"max_decode_len={max_decode_len!r}: must be positive")
    rng = jax.random.key(0) if rng is None else rng
    args = (params, inputs.astype(jnp.int32), rng, prefix)
    outputs = OUTPUTS[2 if token_scores else 1 if scores else 0]
    static = (settings.program(), int(max_decode_len), outputs)
    program = self._program(args, static)
    return self._run(*args, *static) if program is None else program(*args)

  def _prepare(self, params, batches: list, settings: SearchSettings, rng, outputs: str) -> None:
    """Gets the programs of `batches` ((inputs, prefix) of each shape) from `programs`
    concurrently, one thread each (docs/experiments.md measures the gain), before any batch is
    decoded: batches decoded in parallel then only look their program up."""
    calls = [
      (
        (params, x.astype(jnp.int32), rng, prefix),
        (settings.program(), _width(x, prefix) + settings.max_extra_len, outputs),
      )
      for x, prefix in batches
    ]
    if len(calls) == 1:
      self._program(*calls[0])
      return
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
      for done in [pool.submit(self._program, *call) for call in calls]:
        done.result()

  def _program(self, args, static) -> Callable | None:
    """The compiled search for these arguments from `programs` (asked once per signature), or
    None: no `programs`, or arguments on several devices (the `jax.jit` decodes them). Per call
    only a lookup by the arguments' shapes, dtypes and shardings; the signature string is made
    once."""
    if self._programs is None:
      return None
    leaves, tree = jax.tree_util.tree_flatten(args)
    key = (static, tree, tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves))
    if key not in self._compiled:
      devices = set().union(*(x.devices() for x in leaves if isinstance(x, jax.Array)))
      if len(devices) > 1:
        self._compiled[key] = None
        return None
      described = [
        (tuple(x.shape), str(x.dtype), repr(getattr(x, "sharding", None))) for x in leaves
      ]
      signature = "\n".join(
        map(
          str,
          (
            type(self.model).__qualname__,
            self.model.config,
            (self.num_ids, self.ensemble, self.use_cache, self.segment),
            static,
            tree,
            described,
          ),
        )
      )
      device = devices.pop() if devices else jax.devices()[0]
      self._compiled[key] = self._programs(signature, lambda: self._lower(*args, *static), device)
    return self._compiled[key]

  def _kept_search(self, *args):
    """`_search` under another name, for `programs`: its programs' keys in JAX's persistent
    compilation cache never meet the `jax.jit`'s (inference/program_store.py)."""
    return self._search(*args)

  def _search(
    self, params, inputs, rng, prefix, settings: SearchSettings, max_decode_len: int, outputs: str
  ):
    """`model.generate.generate` with this generator's options (traced)."""
    return generate(
      self.model,
      params,
      inputs,
      rng,
      settings,
      max_decode_len,
      outputs,
      num_ids=self.num_ids,
      ensemble=self.ensemble,
      use_cache=self.use_cache,
      segment=self.segment,
      prefix=prefix,
      count_steps=True,
    )

  def translate_all(
    self,
    params,
    token_lists: Sequence[Sequence[int]],
    settings: SearchSettings,
    *,
    rng=None,
    tokens_per_batch: int = 4096,
    batch_multiple: int = 1,
    place: Callable | None = None,
    on_batch: Callable[[int], None] | None = None,
    scores: bool = False,
    token_scores: bool = False,
    prefixes: Sequence[Sequence[int]] | None = None,
    parallel_batches: int = 1,
  ) -> list:
    """The search over any number of sentences, batched by `length_batches`.

    Args:
      token_lists: source ids of each sentence, each ending in EOS.
      tokens_per_batch: padded source tokens per batch (beam search multiplies the work by beam).
      batch_multiple: every batch's row count is a multiple of this (e.g. the devices it is split
        over).
      place: applied to each batch's [rows, length] ids before decoding (e.g. `jax.device_put`
        with a sharding); None leaves them as numpy.
      on_batch: called after each batch with the number of sentences done so far.
      rng: default `jax.random.key(0)`, folded with the batch's number when sampling, so batches
        of the same shape sample independently.

      scores, token_scores: return each sentence's `NBest` (the search's scores, and its
        tokens' log-probabilities), from the same search.
      prefixes: a target prefix per sentence (ids, no EOS; empty: none): its outputs start with
        it. All empty (or None): decoded exactly as without.
      parallel_batches: how many batches are decoded at once, each by its own thread running its
        program to the end (on a CPU, each search's small operations leave cores idle that
        another batch's fill). Every batch's outputs are the same whatever this is; `on_batch`
        is still called in batch order.

    Returns:
      per sentence, in input order: its translation's ids [tokens] (no EOS, no PAD); with
      `settings.num_hypotheses` n > 1, a list of its n best, best first; with `scores` or
      `token_scores`, its `NBest` (all n hypotheses).
    """
    if not isinstance(parallel_batches, int) or parallel_batches < 1:
      raise ValueError(f"parallel_batches={parallel_batches!r}: must be a positive integer")
    outputs: list = [None] * len(token_lists)
    rng = jax.random.key(0) if rng is None else rng
    done = 0
    if prefixes is not None and not any(len(p) for p in prefixes):
      prefixes = None
    batches = length_batches(token_lists, tokens_per_batch, batch_multiple, prefixes)
    put = (lambda x: x) if place is None else place
    want = OUTPUTS[2 if token_scores else 1 if scores else 0]
    if self._programs is not None:  # one batch of each shape: their programs fetched at once
      first = {b.inputs.shape: b for b in reversed(batches)}.values()
      shapes = [(put(b.inputs), b.prefixes) for b in first]
      self._prepare(params, shapes, settings, rng, want)

    def search(n: int):
      found, steps = self._counted(
        params,
        put(batches[n].inputs),
        settings,
        jax.random.fold_in(rng, n) if settings.sampling else rng,  # searches draw nothing
        None,
        scores,
        token_scores,
        batches[n].prefixes,
      )
      found = np.asarray(found) if want == "ids" else [np.asarray(x) for x in found]
      return found, None if steps is None else np.asarray(steps)

    if parallel_batches == 1:
      searched = map(search, range(len(batches)))
    else:
      pool = concurrent.futures.ThreadPoolExecutor(parallel_batches)
      searched = pool.map(search, range(len(batches)))
    rows = settings.beam_size if not settings.sampling else 1  # a sentence's rows in a step
    computed = needed = 0
    try:
      for batch, (found, steps) in zip(batches, searched):
        for row, i in enumerate(batch.indices):
          outputs[i] = _sentence(found, row, want)
        done += len(batch.indices)
        if steps is not None:
          computed += rows * len(steps) * int(steps.max())
          needed += rows * int(steps[: len(batch.indices)].sum())
        if on_batch is not None:
          on_batch(done)
    finally:
      if parallel_batches > 1:
        pool.shutdown(cancel_futures=True)
    self.rows_searched = (computed, needed)
    if needed:
      logging.vlog(
        1,
        "Searched %s rows x steps where the sentences needed %s (%.2fx): a batch steps until "
        "its last sentence is done",
        f"{computed:,}",
        f"{needed:,}",
        computed / needed,
      )
    return outputs


def _sentence(found, row: int, want: str):
  """One sentence's result from its batch's search results `found` (numpy): its ids (or a list
  of its n best), or with scores its `NBest`."""
  if want != "ids":
    return nbest(*(x[row] for x in found))
  return strip(found[row]) if found.ndim == 2 else [strip(h) for h in found[row]]


def _width(inputs, prefix) -> int:
  """The output width before `max_extra_len`: the source's, or the prefix's when wider."""
  return max(inputs.shape[1], 0 if prefix is None else prefix.shape[1])


def translate(
  model,
  params,
  inputs,
  settings: SearchSettings | None = None,
  *,
  rng=None,
  max_decode_len: int | None = None,
  **options,
) -> jax.Array:
  """Best translation of each source row [batch, src_len] -> ids [batch, max_decode_len]: see
  `Generator.__call__`. `settings` (default `SearchSettings()`), or its fields as keywords
  (beam_size=..., alpha=...); the other keywords are `Generator`'s (num_ids, ensemble,
  use_cache, segment). A one-off: it compiles on every call (hold a `Generator` to reuse)."""
  settings, options = with_keywords(settings, options)
  return Generator(model, **options)(
    params, inputs, settings, rng=rng, max_decode_len=max_decode_len
  )


def translate_all(
  model,
  params,
  token_lists: Sequence[Sequence[int]],
  settings: SearchSettings | None = None,
  **options,
) -> list[np.ndarray]:
  """`Generator.translate_all` for a list of sentences (each's ids ending in EOS); keywords:
  the settings' fields, `Generator`'s options, and translate_all's own (rng, tokens_per_batch,
  batch_multiple, place, on_batch, scores, token_scores). Compiles on every call, as
  `translate`."""
  settings, options = with_keywords(settings, options)
  own = {k: options.pop(k) for k in list(options) if k in _BATCHING}
  return Generator(model, **options).translate_all(params, token_lists, settings, **own)


_BATCHING = (
  "rng",
  "tokens_per_batch",
  "batch_multiple",
  "place",
  "on_batch",
  "scores",
  "token_scores",
  "prefixes",
)
