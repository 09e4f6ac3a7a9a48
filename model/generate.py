"""Translation with a trained model: encode once, then greedy, sampled or beam search.

    ids = translate(model, params, inputs, SearchSettings(beam_size=4))  # [batch, max_decode_len]
    outs = translate_all(model, params, token_lists)      # any number of sentences, input order
    ids = translate(model, stacked, inputs, ensemble=True)  # members' params on a leading axis
    generator = Generator(model, num_ids=vocab_size)      # owns its compiled programs

`model` is any module made by `model.build.build_model` (it offers `encode`, `init_cache`,
`decode_step`); model/decoder_state.py turns it into the step function and cache that the
searches of model/search.py run on. Source rows are token ids ending in EOS, padded with 0. Output
rows hold the generated tokens up to and including EOS, then PAD; a row cut by `max_decode_len`
has no EOS.
The decoder never emits PAD (its logit is masked), so PAD only ever means "after EOS".

A `Generator` compiles each distinct (input shape, search settings) once and keeps the programs
while it lives; `translate` and `translate_all` keep a few generators, most recently used first.
"""

from __future__ import annotations

import concurrent.futures
import functools
import re
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from model import search
from model.batching import length_batches
from model.decoder_state import DECODE_SEGMENT, decoder_state, ensemble_decoder_state
from model.search_settings import FIELDS, SearchSettings
from model.special_tokens import EOS_ID, PAD_ID


def _only_ids_below(step, num_ids: int):
  """step_fn whose logits for ids >= num_ids (output rows the vocabulary has no piece for) are
  -inf, so no search can emit them."""

  def masked(ids, cache):
    logits, cache = step(ids, cache)
    return logits.at[:, num_ids:].set(-jnp.inf), cache

  return masked


class Generator:
  """The compiled searches of one model: `generator(params, inputs, settings)` searches, and
  `translate_all` decodes any number of sentences in length batches.

  One program is compiled per distinct (settings.program(), input shape, max_decode_len) and kept
  as long as the generator lives (its `jax.jit`'s cache), parameters being an argument, never
  constants baked in. `inference.Translator` owns one; `translate` below keeps a few, most
  recently used first.

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
    if num_ids is not None and not EOS_ID < num_ids:
      raise ValueError(f"num_ids={num_ids!r}: must exceed the EOS id {EOS_ID}")
    if segment is not None and segment < 1:
      raise ValueError(f"segment={segment!r}: must be positive or None")
    if ensemble and not use_cache:
      raise ValueError(
        "use_cache=False: an ensemble decodes with the key/value cache; use_cache=False is for "
        "single models"
      )
    self.model = model
    self.num_ids = None if num_ids is None or num_ids >= model.config.vocab_size else num_ids
    self.ensemble, self.use_cache, self.segment = ensemble, use_cache, segment
    self._run = jax.jit(self._search, static_argnums=(3, 4))
    self._lower = jax.jit(self._kept_search, static_argnums=(3, 4)).lower
    self._programs = programs
    self._compiled: dict[tuple, Callable | None] = {}  # by arguments' shapes and shardings

  def __call__(
    self, params, inputs, settings: SearchSettings, *, rng=None, max_decode_len=None
  ) -> jax.Array:
    """Best translation of each source row.

    Args:
      params: the model's (unboxed) parameters (stacked members' for an ensemble).
      inputs: [batch, src_len] source ids ending in EOS, 0 on padding.
      settings: how to search; rng (default `jax.random.key(0)`) draws the samples.
      max_decode_len: static output width; default src_len + settings.max_extra_len. Rows
        reaching it stop without EOS.

    Returns:
      ids [batch, max_decode_len] int32: tokens up to EOS, then PAD; with
      `settings.num_hypotheses` n > 1, beam search's n best [batch, n, max_decode_len], best
      first.
    """
    if not isinstance(settings, SearchSettings):
      raise ValueError(f"settings={settings!r}: expected a SearchSettings")
    if getattr(inputs, "ndim", None) != 2:
      inputs = np.asarray(inputs)
    if inputs.ndim != 2:
      raise ValueError(f"inputs: must be [batch, src_len] ids, got shape {inputs.shape}")
    if max_decode_len is None:
      max_decode_len = inputs.shape[1] + settings.max_extra_len
    if max_decode_len < 1:
      raise ValueError(f"max_decode_len={max_decode_len!r}: must be positive")
    rng = jax.random.key(0) if rng is None else rng
    args = (params, inputs.astype(jnp.int32), rng)
    static = (settings.program(), int(max_decode_len))
    program = self._program(args, static)
    return self._run(*args, *static) if program is None else program(*args)

  def _prepare(self, params, inputs: list, settings: SearchSettings, rng) -> None:
    """Gets the programs of `inputs` (one batch of each shape) from `programs` concurrently, one
    thread each (on 2 CPU cores: the two Multi30k programs read back in 0.40 s instead of 0.71,
    compiled in 6.5 s instead of 7.4; docs/experiments.md)."""
    if len(inputs) < 2:
      return
    calls = [
      (
        (params, x.astype(jnp.int32), rng),
        (settings.program(), x.shape[1] + settings.max_extra_len),
      )
      for x in inputs
    ]
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

  def _search(self, params, inputs, rng, settings: SearchSettings, max_decode_len: int):
    """The traced search: [batch, src_len] ids -> [batch, max_decode_len] ids ([batch, n,
    max_decode_len] for n > 1 hypotheses)."""
    batch = inputs.shape[0]
    max_lens = jnp.sum(inputs != PAD_ID, axis=1, dtype=jnp.int32) + settings.max_extra_len
    if self.ensemble:
      state = ensemble_decoder_state(self.model, params, inputs, max_decode_len, self.segment)
    else:
      state = decoder_state(
        self.model, params, inputs, max_decode_len, self.use_cache, self.segment
      )
    step = state.step if self.num_ids is None else _only_ids_below(state.step, self.num_ids)
    loop = dict(max_lens=max_lens, grow=state.grow, segment=state.segment)
    if settings.sampling:
      return search.sample(
        step,
        state.cache,
        rng,
        batch,
        max_decode_len,
        temperature=settings.temperature,
        top_k=settings.top_k,
        **loop,
      )
    if settings.beam_size == 1:
      return search.greedy_search(step, state.cache, batch, max_decode_len, **loop)
    ids, _ = search.beam_search(
      step,
      state.cache,
      batch,
      max_decode_len,
      beam_size=settings.beam_size,
      alpha=settings.alpha,
      penalty=settings.length_penalty,
      **loop,
    )
    return ids[:, 0] if settings.num_hypotheses == 1 else ids[:, : settings.num_hypotheses]

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
  ) -> list[np.ndarray]:
    """The search over any number of sentences, batched by `length_batches`.

    Args:
      token_lists: source ids of each sentence, each ending in EOS.
      tokens_per_batch: padded source tokens per batch (beam search multiplies the work by beam).
      batch_multiple: every batch's row count is a multiple of this (e.g. the devices it is split
        over).
      place: applied to each batch's [rows, length] ids before decoding (e.g. `jax.device_put`
        with a sharding); None leaves them as numpy.
      on_batch: called after each batch with the number of sentences done so far.
      rng: default `jax.random.key(0)`, folded with the batch's number, so batches of the same
        shape sample independently.

    Returns:
      per sentence, in input order: its translation's ids [tokens] (no EOS, no PAD); with
      `settings.num_hypotheses` n > 1, a list of its n best, best first.
    """
    outputs: list = [None] * len(token_lists)
    rng = jax.random.key(0) if rng is None else rng
    done = 0
    batches = length_batches(token_lists, tokens_per_batch, batch_multiple)
    if self._programs is not None:  # one batch of each shape: their programs fetched at once
      first = {b.inputs.shape: b.inputs for b in reversed(batches)}.values()
      self._prepare(params, [x if place is None else place(x) for x in first], settings, rng)
    for n, batch in enumerate(batches):
      inputs = batch.inputs if place is None else place(batch.inputs)
      ids = np.asarray(self(params, inputs, settings, rng=jax.random.fold_in(rng, n)))
      for row, i in enumerate(batch.indices):
        outputs[i] = strip(ids[row]) if ids.ndim == 2 else [strip(h) for h in ids[row]]
      done += len(batch.indices)
      if on_batch is not None:
        on_batch(done)
    return outputs


def generator(
  model,
  *,
  num_ids: int | None = None,
  ensemble: bool = False,
  use_cache: bool = True,
  segment: int | None = DECODE_SEGMENT,
) -> Generator:
  """A `Generator` of `model` (options as its constructor's), made once and kept while it is
  among the 8 most recently used: the functions below share its compiled programs."""
  if num_ids is not None and num_ids >= model.config.vocab_size:
    num_ids = None  # masks nothing: the same programs as without
  return _generator(model, num_ids, ensemble, use_cache, segment)


@functools.lru_cache(maxsize=8)
def _generator(model, num_ids, ensemble, use_cache, segment) -> Generator:
  return Generator(model, num_ids=num_ids, ensemble=ensemble, use_cache=use_cache, segment=segment)


def _split(search, settings):
  """(settings, generator options) from `translate`'s keyword arguments."""
  fields = {k: search.pop(k) for k in list(search) if k in FIELDS}
  if settings is None:
    settings = SearchSettings(**fields)
  elif fields:
    settings = settings.replace(**fields)
  return settings, search


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
  use_cache, segment)."""
  settings, options = _split(dict(options), settings)
  return generator(model, **options)(
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
  batch_multiple, place, on_batch)."""
  settings, options = _split(dict(options), settings)
  own = {k: options.pop(k) for k in list(options) if k in _BATCHING}
  return generator(model, **options).translate_all(params, token_lists, settings, **own)


_BATCHING = ("rng", "tokens_per_batch", "batch_multiple", "place", "on_batch")


def strip(ids) -> np.ndarray:
  """[length] ids -> the tokens before the first EOS, PAD dropped."""
  ids = np.asarray(ids).reshape(-1)
  eos = np.flatnonzero(ids == EOS_ID)
  if len(eos):
    ids = ids[: eos[0]]
  return ids[ids != PAD_ID]


# ---------------------------------------------------------------------------------------------
# Attention weights for plotting.


def _natural_key(path):
  return [tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", str(k))) for k in path]


@functools.lru_cache(maxsize=4)
def _weights_fn(model):
  """The jitted (params, inputs, targets) -> sown intermediates of `model`."""

  def forward(mdl, src, tgt):
    return mdl.decode(mdl.encode(src), src, tgt, return_weights=True)

  def run(params, src, tgt):
    _, state = model.apply({"params": params}, src, tgt, method=forward, mutable=["intermediates"])
    return state["intermediates"]

  return jax.jit(run)


def attention_weights(model, params, inputs, output_ids) -> np.ndarray:
  """Encoder-decoder attention of one sentence pair, for plotting.

  Args:
    inputs: [src_len] source ids ending in EOS (PAD dropped).
    output_ids: [length] its translation, read up to the first EOS; EOS is appended when
      missing, so the last target row is the EOS position.

  Returns:
    [layers, heads, tgt_len, src_len] float32 weights (each row sums to 1 over the source).
  """
  src = np.asarray(inputs).reshape(-1)
  src = src[src != PAD_ID]
  tgt = np.append(strip(output_ids), EOS_ID)
  flat = traverse_util.flatten_dict(
    _weights_fn(model)(params, src[None].astype(np.int32), tgt[None].astype(np.int32))
  )
  found = sorted(
    (path for path in flat if path[-1] == "attention_weights" and "cross_attention" in path),
    key=_natural_key,
  )
  if not found:
    raise ValueError(f"attention_weights: {type(model).__name__} sowed no cross-attention weights")
  return np.stack([np.asarray(flat[p][0][0], np.float32) for p in found])
