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

import collections
import concurrent.futures
import threading
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from core.cpu import usable_cores
from inference.merged_search import (
  first_batch_limits,
  merged_translate,
  piece_programs,
  piece_stops,
  whole_batches_recut,
)
from model import beam_pieces, distribution
from model.decoder_state import DECODE_SEGMENT
from model.generate import OUTPUTS, best_outputs, generate, nbest, strip
from model.length_buckets import checked_prefixes, length_batches
from model.search_settings import SearchSettings, with_keywords


class Generator:
  """The compiled searches of one model: `generator(params, inputs, settings)` searches, and
  `translate_all` decodes any number of sentences in length batches.

  One program is compiled per distinct (settings.program(), input shape, max_decode_len, and
  whether scores are returned), and `translate_all`'s merged beam search one per piece of each
  batch shape's search (`beam_pieces`: begin, and on from each pause), all kept as long as the
  generator lives (its `jax.jit`'s cache), parameters being an argument, never constants baked
  in. A beam search's alpha and stopping rule are arguments, and `translate_all`'s beam
  searches return every hypothesis with its score (`_program_of`), so settings that differ
  only there (alpha, stopping, num_hypotheses, scores) share programs. `inference.Translator`
  owns one; `translate` below makes one per call.

  Args:
    model: a module from `model.build.build_model`, or a `DeferredModel`.
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
      it runs on (and, for a piece of a merged search, `what=` naming it for logs); returns the
      compiled program, called with (params, inputs, rng) (a piece's: (params, inputs or
      piece)). Arguments spread over several devices are decoded by the `jax.jit` as without.
    merge: `translate_all` merges the sentences still searching across batches where it can
      (inference/merged_search.py: beam search of one model on one device, no prefix); the same
      outputs, fewer rows searched for sentences already done. False: each batch on its own.
    cut_first: a merged search's batches hold at most its later pieces' sentences and tokens
      (`merged_search.LATER_BATCH`, `LATER_TOKENS`), its first pieces too, so that a bigger
      `tokens_per_batch` searches exactly as the smaller; None: where the parameters are on a
      CPU (there a bigger first piece steps more rows for its stragglers than its fewer product
      calls save: docs/experiments.md).
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
    merge: bool = True,
    cut_first: bool | None = None,
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
    self.merge, self.cut_first = merge, cut_first
    self._run = jax.jit(self._search, static_argnums=(5, 6, 7))
    self._lower = jax.jit(self._kept_search, static_argnums=(5, 6, 7)).lower
    self._run_piece = jax.jit(self._piece, static_argnums=(3, 4, 5, 6, 7, 8))
    self._lower_piece = jax.jit(self._kept_piece, static_argnums=(3, 4, 5, 6, 7, 8)).lower
    self._programs = programs
    self._compiled: dict[tuple, Callable | None] = {}  # by arguments' shapes and shardings
    self._initial_shapes: dict[tuple, object] = {}  # a merged search's piece before its start
    self._shapes_lock = threading.Lock()
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
      settings: how to search; rng (default `jax.random.key(0)`) draws the samples (None
        when not sampling: the key is made, a small program, only when asked for).
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
    want = OUTPUTS[2 if token_scores else 1 if scores else 0]
    return self._counted(params, inputs, settings, rng, max_decode_len, want, prefix)[0]

  def _counted(
    self, params, inputs, settings, rng, max_decode_len, want, prefix, shared=False
  ) -> tuple:
    """(`__call__`'s result, [batch] int32 the steps each row searched before it was done, or
    None for Marian's search); `want` one of OUTPUTS. `shared`: the search's program is
    `_program_of`'s, its results as the program returns them (`_cut` gives `want`'s)."""
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
    rng = jax.random.key(0) if rng is None and settings.sampling else rng
    searched, rule, outputs = (
      _program_of(settings, want) if shared else (*_searched(settings), want)
    )
    args = (params, inputs.astype(jnp.int32), rng, prefix, rule)
    static = (searched, int(max_decode_len), outputs)
    program = self._program(args, static)
    return self._run(*args, *static) if program is None else program(*args)

  def _prepare(self, params, batches: list, settings: SearchSettings, rng, want: str) -> None:
    """Gets the programs of `batches` ((inputs, prefix) of each shape) from `programs`
    concurrently, one thread each (docs/experiments.md measures the gain), before any batch is
    decoded: batches decoded in parallel then only look their program up (`_counted`'s
    `shared` programs for `want`)."""
    program, rule, outputs = _program_of(settings, want)
    calls = [
      (
        (params, x.astype(jnp.int32), rng, prefix, rule),
        (program, _width(x, prefix) + settings.max_extra_len, outputs),
      )
      for x, prefix in batches
    ]
    _at_once(self._program, calls)

  def _program(self, args, static, lower=None, describe=None, what=None) -> Callable | None:
    """The compiled search for these arguments from `programs` (asked once per signature), or
    None: no `programs`, or arguments on several devices (the `jax.jit` decodes them). Per call
    only a lookup by the arguments' shapes, dtypes and shardings; the signature string is made
    once. `lower` (default: the whole search's) returns the program's `Lowered`; `describe`:
    the arguments the signature and lookup name instead of `args` (a piece's are named by its
    batch's inputs: beam_pieces' state follows from them); `what`: `programs`' name for it."""
    if self._programs is None:
      return None
    leaves, tree = jax.tree_util.tree_flatten(args if describe is None else describe)
    key = (static, tree, tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves))
    if key not in self._compiled:
      self._compiled[key] = self._fetch(args, static, lower, tree, leaves, what)
    return self._compiled[key]

  def _fetch(self, args, static, lower, tree, leaves, what) -> Callable | None:
    """`_program`'s program, from `programs` (None: arguments on several devices)."""
    devices = _devices(leaves)
    if len(devices) > 1:
      return None
    described = [(tuple(x.shape), str(x.dtype), repr(getattr(x, "sharding", None))) for x in leaves]
    signature = "\n".join(
      map(
        str,
        (
          self.model.kind,
          self.model.config,
          (self.num_ids, self.ensemble, self.use_cache, self.segment),
          static,
          tree,
          described,
        ),
      )
    )
    device = devices.pop() if devices else jax.devices()[0]
    lower = lower or (lambda: self._lower(*args, *static))
    if what is None:
      return self._programs(signature, lower, device)
    return self._programs(signature, lower, device, what=what)

  def _kept_search(self, *args):
    """`_search` under another name, for `programs`: its programs' keys in JAX's persistent
    compilation cache never meet the `jax.jit`'s (inference/program_store.py)."""
    return self._search(*args)

  def _search(
    self,
    params,
    inputs,
    rng,
    prefix,
    rule,
    settings: SearchSettings,
    max_decode_len: int,
    outputs: str,
  ):
    """`model.generate.generate` with this generator's options (traced); `rule` the search's
    alpha and stopping rule when they come as arguments (`_searched`: [2] float32,
    `SearchSettings.rule_values`), else None."""
    if rule is not None:
      settings = settings.with_rule(rule)
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

  def _piece(self, params, x, rule, settings, max_len, outputs, start, until, segment):
    """`beam_pieces.begin` of inputs `x` (`start` 0) or `resume` of piece `x` paused at
    `start`, to step `until`, with this generator's options and self-attention buffers growing
    from `segment` positions (None: all `max_len` from the start) (traced); `rule` as
    `_search`'s."""
    if rule is not None:
      settings = settings.with_rule(rule)
    keywords = dict(outputs=outputs, num_ids=self.num_ids, segment=segment)
    if not start:
      return beam_pieces.begin(self.model, params, x, settings, max_len, until, **keywords)
    return beam_pieces.resume(self.model, params, x, settings, max_len, start, until, **keywords)

  def _kept_piece(self, *args):
    """`_piece` under another name, for `programs` (as `_kept_search`)."""
    return self._piece(*args)

  def _piece_program(self, params, shape, rule, static) -> Callable | None:
    """`_program` of `_piece(params, x, rule, *static)` for a batch of `shape` (x its inputs,
    or a piece of its entries); named by the batch's inputs, so that a run that reads the
    program back traces nothing (the piece's shapes follow from them)."""
    settings, max_len, outputs, start, until, segment = static

    def lower():
      x = jax.ShapeDtypeStruct(shape, jnp.int32)
      if start:
        with self._shapes_lock:  # one trace of the encoder for all of a shape's pieces
          key = (shape, settings, max_len, outputs, jax.tree_util.tree_structure(params))
          if key not in self._initial_shapes:
            self._initial_shapes[key] = beam_pieces.initial_shape(
              self.model, params, x, settings, max_len, outputs=outputs, segment=segment
            )
        x = beam_pieces.paused_shape(self._initial_shapes[key], start, max_len, segment)
      return self._lower_piece(params, x, rule, *static)

    named = (params, np.zeros(shape, np.int32), rule)
    what = f"int32[{shape[0]},{shape[1]}], steps {start}-{until}"
    return self._program(None, ("beam piece", *static), lower, named, what)

  def _merging(self, settings: SearchSettings, prefixes, params) -> bool:
    """Whether `translate_all` searches in merged pieces (`merge`, a search `beam_pieces`
    runs, parameters on one device)."""
    if not self.merge or self.segment is None:
      return False
    if not beam_pieces.supported(
      settings, ensemble=self.ensemble, use_cache=self.use_cache, prefix=prefixes
    ):
      return False
    return len(_devices(params)) <= 1

  def _merged(self, params, batches, settings, want, parallel_batches, finish) -> tuple:
    """`translate_all`'s search of `batches` in merged pieces (inference/merged_search.py):
    (rows x steps searched, rows x steps needed)."""
    program, rule, outputs = _program_of(settings, want)
    device = next(iter(_devices(params)), None)

    def static_of(shape, start, until) -> tuple:
      """A piece's static arguments. A search in one piece (a shape of few sentences) runs as
      one loop over buffers of all its positions, not in growing segments: its program is about
      a third the size to compile and read back, which matters more to a few batches than the
      positions they attend over before writing them (docs/experiments.md)."""
      max_len = shape[1] + settings.max_extra_len
      segment = None if (start, until) == (0, max_len) else self.segment
      return (program, max_len, outputs, start, until, segment)

    def run(shape, x, start, until):
      static = static_of(shape, start, until)
      if (shape, start, until) in ahead:  # its program read back or compiled in the background
        ahead[shape, start, until].result()
      before = 0
      if start:  # a piece of waiting entries comes as numpy, one going on as it is on its device
        before = int(np.asarray(x.state.computed).sum())  # numpy's sum: nothing to compile
        x = jax.device_put(x, device)
      compiled = self._piece_program(params, shape, rule, static)
      call = (lambda *a: self._run_piece(*a, *static)) if compiled is None else compiled
      piece, found = call(params, x, rule)
      found = _cut(found, outputs, want, settings)
      s = piece.state
      computed = int(np.asarray(s.computed).sum()) - before
      return piece, found, np.asarray(s.done), computed, np.asarray(s.searched)

    counts = collections.Counter()  # sentences of each shape
    for b in batches:
      counts[b.inputs.shape] += len(b.indices)
    stops = {
      shape: piece_stops(shape, shape[1] + settings.max_extra_len, self.segment, n)
      for shape, n in counts.items()
    }
    ahead, fetching = {}, None
    if self._programs is not None and batches:
      # Every piece program is read back (or compiled) in the background, in the order the
      # pieces first need them (the batches' shapes in their order, each one's stages in turn),
      # while the pieces whose programs are ready are searched; a piece waits only for its own.
      # A thread per core at most: compiling is CPU work, a thread more only slows the first.
      calls = {}
      for shape, ends in stops.items():
        for at, a, b in piece_programs(shape, ends):
          calls.setdefault((at, a, b), (params, at, rule, static_of(at, a, b)))
      fetching = concurrent.futures.ThreadPoolExecutor(min(parallel_batches, usable_cores()))
      ahead.update((key, fetching.submit(self._piece_program, *c)) for key, c in calls.items())
    try:
      rows = merged_translate(
        run, batches, stops.__getitem__, settings.beam_size, parallel_batches, finish
      )
    except BaseException:
      if fetching is not None:
        fetching.shutdown(cancel_futures=True)
      raise
    if fetching is not None:  # every program fetched, as every run of the same file fetches them
      fetching.shutdown()
    return rows

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
      on_batch: called with the number of sentences done so far, after each batch (each
        sentence, in a merged search: see `merge`).
      rng: default `jax.random.key(0)`, folded with the batch's number when sampling, so batches
        of the same shape sample independently (not made when not sampling).

      scores, token_scores: return each sentence's `NBest` (the search's scores, and its
        tokens' log-probabilities), from the same search.
      prefixes: a target prefix per sentence (ids, no EOS; empty: none): its outputs start with
        it. All empty (or None): decoded exactly as without.
      parallel_batches: how many batches (or pieces of merged searches) are decoded at once,
        each by its own thread running its program to the end (on a CPU, each search's small
        operations leave cores idle that another batch's fill). Every sentence's outputs are the
        same whatever this is.

    Returns:
      per sentence, in input order: its translation's ids [tokens] (no EOS, no PAD); with
      `settings.num_hypotheses` n > 1, a list of its n best, best first; with `scores` or
      `token_scores`, its `NBest` (all n hypotheses).
    """
    if not isinstance(parallel_batches, int) or parallel_batches < 1:
      raise ValueError(f"parallel_batches={parallel_batches!r}: must be a positive integer")
    outputs: list = [None] * len(token_lists)
    rng = jax.random.key(0) if rng is None and settings.sampling else rng
    done = 0
    if prefixes is not None and not any(len(p) for p in prefixes):
      prefixes = None
    merging = self._merging(settings, prefixes, params)
    max_rows = None
    if merging and (self.cut_first if self.cut_first is not None else _on_cpu(params)):
      tokens_per_batch, max_rows = first_batch_limits(tokens_per_batch)
    batches = length_batches(token_lists, tokens_per_batch, batch_multiple, prefixes, max_rows)
    put = (lambda x: x) if place is None else place
    want = OUTPUTS[2 if token_scores else 1 if scores else 0]
    if merging:
      batches = whole_batches_recut(batches, settings.max_extra_len, self.segment)
      placed = [b._replace(inputs=put(b.inputs)) for b in batches]

      def finish(i: int, found, row: int):
        nonlocal done
        outputs[i] = _sentence(found, row, want)
        done += 1
        if on_batch is not None:
          on_batch(done)

      rows = self._merged(params, placed, settings, want, parallel_batches, finish)
      self._report(*rows)
      return outputs
    returned = _program_of(settings, want)[2]  # what each batch's program returns
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
        want,
        batches[n].prefixes,
        shared=True,
      )
      found = _cut(found, returned, want, settings)
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
    self._report(computed, needed)
    return outputs

  def _report(self, computed: int, needed: int) -> None:
    """Keeps and logs (verbosity 1) the rows x steps a `translate_all` searched and needed."""
    self.rows_searched = (computed, needed)
    if needed:
      logging.vlog(
        1,
        "Searched %s rows x steps where the sentences needed %s (%.2fx)",
        f"{computed:,}",
        f"{needed:,}",
        computed / needed,
      )


def _devices(tree) -> set:
  """The devices the `jax.Array` leaves of `tree` are on (none for numpy leaves)."""
  leaves = jax.tree_util.tree_leaves(tree)
  return set().union(*(x.devices() for x in leaves if isinstance(x, jax.Array)))


def _on_cpu(params) -> bool:
  """Whether the parameters are on a CPU (numpy leaves: the default device's platform)."""
  devices = _devices(params) or set(jax.devices()[:1])
  return all(d.platform == "cpu" for d in devices)


def _at_once(fetch: Callable, calls: list) -> None:
  """`fetch(*call)` for every call, each in its own thread (one: in this one)."""
  if len(calls) == 1:
    fetch(*calls[0])
    return
  with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
    for done in [pool.submit(fetch, *call) for call in calls]:
      done.result()


def _sentence(found, row: int, want: str):
  """One sentence's result from its batch's search results `found` (numpy): its ids (or a list
  of its n best), or with scores its `NBest`."""
  if want != "ids":
    return nbest(*(x[row] for x in found))
  return strip(found[row]) if found.ndim == 2 else [strip(h) for h in found[row]]


def _searched(settings: SearchSettings) -> tuple[SearchSettings, np.ndarray | None]:
  """(the static settings of `settings`' compiled search, its rule argument or None): a beam
  search under the 'gnmt' or 'fairseq' penalty takes its alpha and stopping rule as arguments
  ([2] float32: `SearchSettings.rule_values`; Marian's beam search its `normalize` as alpha, its
  own stopping kept), so that one program serves every alpha and both stopping rules (a sweep on
  a dev set compiles once); its scores and stops are the same as with them constants
  (`model.search.length_penalty`)."""
  program = settings.program()
  if not settings.rule_argument:
    return program, None
  static = program.replace(alpha=0.0, stopping=None)
  return static, np.asarray(settings.rule_values(), np.float32)


def _program_of(settings: SearchSettings, want: str) -> tuple:
  """(static settings, rule argument or None, outputs) of `translate_all`'s program for
  `settings` returning `want` (one of OUTPUTS): `_searched`'s, and a search whose rule is an
  argument (`SearchSettings.rule_argument`) returns all its beam's hypotheses with their scores
  whatever `num_hypotheses` and `want` (token scores still a program of their own: the search
  tracks them), so that a file translated again with `--nbest` or `--scores` reads the same
  programs back; `_cut` takes what was asked for on the host."""
  program, rule = _searched(settings)
  if not settings.rule_argument:
    return program, rule, want
  wide = OUTPUTS[max(OUTPUTS.index(want), 1)]
  return program.replace(num_hypotheses=settings.beam_size), rule, wide


def _cut(found, outputs: str, want: str, settings: SearchSettings):
  """`found`, a program's results returning `outputs` (`_program_of`), as numpy arrays cut to
  `want` and `settings.num_hypotheses` (`model.generate.best_outputs`' shapes)."""
  if outputs == "ids":
    return np.asarray(found)
  found = [np.asarray(x) for x in found]
  if not settings.rule_argument:  # the program returned `want` itself
    return found
  cut = best_outputs(found, OUTPUTS.index(want) + 1, settings.num_hypotheses)
  return cut if want == "ids" else list(cut)


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
