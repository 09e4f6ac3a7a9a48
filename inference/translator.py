"""Translation from Python: load a trained workdir once, then translate lists of sentences and
score them.

    from inference import Translator
    translator = Translator.load("runs/m30k_tiny_ende", checkpoint="average:5")
    translator.translate(["A man is riding a bicycle."], beam_size=5, alpha=1.5)
    translator.translate(["A man is riding a bicycle."], target_prefixes=["Ein Mann"])
    translator.metrics(hypotheses, references)   # sacreBLEU cased and lowercased, chrF

Sentences are plain text: the vocabulary tokenizes them (EOS appended), batches of similar
length are decoded together, and the outputs are detokenized in input order. An empty sentence
translates to an empty string; one longer than the model takes (`model.max_len` tokens) is cut,
with a warning naming how many were. A target prefix (text, tokenized without EOS) makes a
translation start with it, the search going on from its end; an empty one changes nothing.
decode.py is the command line over this module.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import numpy as np

from core.cpu import usable_cores
from core.errors import UsageError
from core.progress import Progress
from core.rules import Choice, Int, RuleError
from data.tokenizer import encode_source, warn_cut
from inference.attention_weights import attention_weights
from inference.continuous import PoolPrograms, decode_continuous
from inference.generator import Generator
from inference.pair_scoring import PairScore, PairScorer
from inference.restore import Restored, place, restore
from model import generate
from model.config import AUTO, INT8
from model.config import DTYPES as MODEL_DTYPES
from model.length_buckets import bucket_length
from model.search_settings import FIELDS, SearchSettings, with_keywords
from training.translation_metrics import Metrics, corpus_metrics

# What `run`'s options besides the search settings may be; decode.py checks its flags of the same
# names with these (the search settings check themselves: model/search_settings.py).
OPTION_RULES = {
  "seed": Int(),
  "tokens_per_batch": Int(min=1),
  "batching": Choice("length", "continuous"),
  "pool_size": Int(min=1),
  "parallel_batches": Int(min=1),
}
# The dtypes decoding offers: model/config.py's, less float16 (not offered for decoding), with
# 'auto' (core/cpu.py's choice for the devices) first.
DTYPES = (AUTO, *(name for name in MODEL_DTYPES if name != "float16"), INT8)
# Padded source tokens per batch by default, per platform. On CPUs small batches win: a batch
# runs until its slowest sentence ends, and a larger one gains little per step there
# (docs/experiments.md, "Decoding speed", has the measurements).
TOKENS_PER_BATCH = {"cpu": 512, "gpu": 4096, "tpu": 4096}


@dataclasses.dataclass
class Translations:
  """The outcome of `Translator.run`, per input sentence in input order.

  Attributes:
    texts: the translations ("" for an empty sentence).
    source_ids: the token ids the model read, EOS included (None for an empty sentence).
    output_ids: the ids it wrote, without EOS (None for an empty sentence).
    truncated: indices of the sentences cut to `model.max_len` tokens.
    seconds: wall time of the decoding, compilation included.
    hypotheses: with scores or `num_hypotheses` > 1, each sentence's best hypotheses, best first
      ([] for an empty sentence); `texts` holds the first of each.
    scores: their scores, as the search ranks them: the log-probability (EOS included; an EOS
      forced at the sentence's length limit costs 0, as in the search) over the length penalty
      in beam search, the plain log-probability in greedy search and sampling.
    token_scores: on request, each hypothesis' per-token log-probabilities (EOS last).
    All three come from the search itself (`model.generate.NBest`): no second pass.
  """

  texts: list[str]
  source_ids: list[list[int] | None]
  output_ids: list[np.ndarray | None]
  truncated: list[int]
  seconds: float
  hypotheses: list[list[str]] | None = None
  scores: list[list[float]] | None = None
  token_scores: list[list[np.ndarray]] | None = None

  @property
  def sentences(self) -> int:
    """Non-empty sentences translated."""
    return sum(ids is not None for ids in self.source_ids)

  @property
  def tokens(self) -> int:
    """Output tokens written."""
    return sum(len(ids) for ids in self.output_ids if ids is not None)


class Translator:
  """A trained model ready to translate: its config, vocabulary and parameters on the devices.

  Make one with `Translator.load(workdir, checkpoint)`; inference/restore.py restores and places
  the model (`devices`, `dtype`: `inference.restore.place`; `dtype_reason` says why the dtype is
  what it is). It translates lists of sentences
  (`run`, `translate`; a stream is read a list at a time), and hands forced scoring to
  inference/pair_scoring.py (`score_pairs`), metrics to training/translation_metrics.py
  (`metrics`) and attention to inference/attention_weights.py (`attention`).

  `programs`: an `inference.program_store.ProgramStore` the searches' compiled programs come
  from and go to (`Translator.load(..., compilation_cache=...)` makes one), on one device only;
  kept as `programs` (None without).
  """

  def __init__(
    self, restored: Restored, *, dtype: str | None = "auto", devices=None, programs=None
  ):
    if dtype is not None and dtype not in DTYPES:
      raise UsageError(f"dtype={dtype!r}: expected one of {', '.join(DTYPES)}")
    self.loaded = place(restored, dtype=dtype, devices=devices)
    self.restored, self.config, self.vocab = restored, restored.config, restored.vocab
    self.model, self.dtype = self.loaded.model, self.loaded.dtype
    self.dtype_reason = self.loaded.dtype_reason
    self.devices, self.params = self.loaded.devices, self.loaded.params
    self._scorer = None
    self._pools = PoolPrograms()
    self.programs = programs
    self.generator = Generator(
      self.model,
      num_ids=self.vocab.vocab_size,
      ensemble=restored.ensemble,
      programs=programs if len(self.devices) == 1 else None,
    )

  @classmethod
  def load(
    cls,
    workdir,
    checkpoint: str = "latest",
    *,
    dtype: str | None = "auto",
    devices=None,
    compilation_cache: bool | str = False,
    read_ahead: bool = False,
  ):
    """From a training workdir alone (`inference.restore.restore`: `checkpoint` 'latest', a step,
    'average:<k>' or 'ensemble:<k>'; `compilation_cache` True, a folder, or False/None/'off';
    `read_ahead`: the last run's programs read back in the background, `programs.finish()` to be
    called once done)."""
    restored, programs = restore(
      workdir, checkpoint, compilation_cache=compilation_cache, read_ahead=read_ahead
    )
    try:
      return cls(restored, dtype=dtype, devices=devices, programs=programs)
    except BaseException:  # a bad option: its error not held up by the programs read ahead
      if programs is not None:
        programs.finish()
      raise

  @property
  def step(self) -> int:
    return self.restored.step

  @property
  def max_len(self) -> int:
    """The longest source the model takes, in tokens, EOS included."""
    return int(self.config.model.max_len)

  def encode(self, sentences: Sequence[str]) -> tuple[list[list[int] | None], list[int]]:
    """(token ids + EOS of each sentence, None for an empty one; indices of those cut to
    `max_len`)."""
    ids, cut = [], []
    for index, sentence in enumerate(sentences):
      text = sentence.strip()
      if not text:
        ids.append(None)
        continue
      tokens, was_cut = encode_source(self.vocab, text, self.max_len)
      ids.append(tokens)
      if was_cut:
        cut.append(index)
    return ids, cut

  def encode_prefixes(
    self, prefixes: Sequence[str] | None, count: int, first_line: int = 1
  ) -> list[list[int]] | None:
    """The target prefixes' token ids (no EOS; [] for an empty one), None for None or all
    empty; UsageError unless there are `count` of them, each shorter than `max_len` tokens."""
    if prefixes is None:
      return None
    if isinstance(prefixes, str) or len(prefixes) != count:
      given = "one string" if isinstance(prefixes, str) else f"{len(prefixes)}"
      raise UsageError(f"target_prefixes: {given} given for {count} sentences; give one each")
    ids = [self.vocab.encode_target(p.strip()) if p.strip() else [] for p in prefixes]
    for index, tokens in enumerate(ids):
      if len(tokens) >= self.max_len:
        raise UsageError(
          f"target prefix of line {index + first_line}: {len(tokens)} tokens, more than the "
          f"model writes (model.max_len={self.max_len}, EOS included)"
        )
    return ids if any(ids) else None

  def translate(
    self, sentences: Sequence[str], settings: SearchSettings | None = None, **options
  ) -> list[str]:
    """The translation of each sentence, in order. Settings and options as `run`."""
    return self.run(sentences, settings, **options).texts

  def run(
    self,
    sentences: Sequence[str],
    settings: SearchSettings | None = None,
    *,
    seed: int = 0,
    tokens_per_batch: int | None = None,
    progress: bool = False,
    return_scores: bool = False,
    return_token_scores: bool = False,
    first_line: int = 1,
    batching: str = "length",
    pool_size: int = 32,
    target_prefixes: Sequence[str] | None = None,
    parallel_batches: int | None = None,
    **search,
  ) -> Translations:
    """Translates `sentences` with `settings`, or with the fields of `SearchSettings` given as
    keywords (beam_size=5, alpha=1.0, length_penalty='fairseq', max_extra_len, temperature,
    top_k; see model/search_settings.py); `max_extra_len` defaults to the training config's
    eval.max_decode_extra. `seed` draws the samples. Batches hold `tokens_per_batch` padded
    source tokens (default `TOKENS_PER_BATCH` of the devices' platform). `progress`: a progress
    bar on stderr when it is a terminal. `num_hypotheses=k` (a search setting) returns each
    sentence's k best with their scores, as `return_scores` does for one; `return_token_scores`
    adds each one's per-token log-probabilities (`Translations`): the search's own, under the
    distribution it drew from.
    `first_line`: the line number of the first sentence, in warnings (a chunk of a stream).
    `batching='continuous'`: the sentences go through a pool of `pool_size` decoding rows, each
    sentence entering as soon as one leaves (inference/continuous.py), instead of batches of similar
    length decoded until their longest sentence ends; the same translations in float32 (samples
    are drawn per sentence instead). It decodes on one device, the best hypothesis only: with
    several devices or `num_hypotheses` > 1, length batches are used.
    `target_prefixes`: one text per sentence ("" for none): every hypothesis of that sentence
    starts with its tokens and the search goes on from there (as CTranslate2's `target_prefix`),
    with any search and batching; its scores count the prefix as forced decoding does
    (`score_pairs(as_search=True)`). An empty sentence still translates to "".
    `parallel_batches`: length batches decoded at once, each by its own thread (the same
    translations whatever it is); default: on one CPU device one more than the cores this process
    may use (`core.cpu.usable_cores`: a program runs on one core, and a thread's host work
    between its pieces would leave that core idle without a thread more; docs/experiments.md),
    else 1."""
    if isinstance(sentences, str):
      raise UsageError("translate: expected a list of sentences, got one string")
    settings = self.settings(settings, **search)
    if tokens_per_batch is None:
      tokens_per_batch = TOKENS_PER_BATCH.get(self.devices[0].platform, TOKENS_PER_BATCH["gpu"])
    if parallel_batches is None:
      one_cpu = len(self.devices) == 1 and self.devices[0].platform == "cpu"
      parallel_batches = usable_cores() + 1 if one_cpu else 1
    self.check_options(
      seed=seed,
      tokens_per_batch=tokens_per_batch,
      batching=batching,
      pool_size=pool_size,
      parallel_batches=parallel_batches,
    )
    prefixes = self.encode_prefixes(target_prefixes, len(sentences), first_line)
    source_ids, cut = self.encode(sentences)
    warn_cut([i + first_line for i in cut], len(sentences), self.max_len)
    present = [i for i, ids in enumerate(source_ids) if ids is not None]
    bar = Progress(len(present), 0, unit="sentences", enabled=progress)
    start = time.perf_counter()
    if prefixes is not None:
      prefixes = [prefixes[i] for i in present]
    scored = settings.num_hypotheses > 1 or return_scores or return_token_scores
    wanted = dict(scores=scored, token_scores=return_token_scores, prefixes=prefixes)
    ids = [source_ids[i] for i in present]
    if batching == "continuous" and len(self.devices) == 1 and settings.num_hypotheses == 1:
      outputs = self._pooled(ids, settings, jax.random.key(seed), pool_size, bar, **wanted)
    else:
      wanted["parallel_batches"] = parallel_batches
      rng = jax.random.key(seed) if settings.sampling else None  # a search draws nothing
      outputs = self._batched(ids, settings, rng, tokens_per_batch, bar, wanted)
    seconds = time.perf_counter() - start
    bar.close()
    found: list = [None] * len(source_ids)  # per sentence: its ids, or with scores its NBest
    for i, out in zip(present, outputs):
      found[i] = out
    return self._translations(found, source_ids, cut, seconds, scored, return_token_scores)

  def _batched(self, ids, settings: SearchSettings, rng, tokens_per_batch: int, bar, wanted):
    """The translations of `ids` in batches of similar length (inference/generator.py), placed
    on this translator's devices, in input order."""
    return self.generator.translate_all(
      self.loaded.search_params,
      ids,
      settings,
      rng=rng,
      tokens_per_batch=tokens_per_batch,
      batch_multiple=len(self.devices),
      place=lambda inputs: jax.device_put(inputs, self.loaded.rows),
      on_batch=bar.update,
      **wanted,
    )

  def _translations(
    self, found: list, source_ids, cut, seconds: float, scored: bool, token_scores: bool
  ) -> Translations:
    """`Translations` of the search's outputs `found` (per sentence: None for an empty one, its
    ids, or with `scored` its NBest), texts decoded."""
    output_ids = [f.ids[0] if scored and f is not None else f for f in found]
    texts = ["" if ids is None else self.vocab.decode(ids.tolist()) for ids in output_ids]
    result = Translations(texts, source_ids, output_ids, cut, seconds)
    if scored:
      none = [f is None for f in found]
      decoded = lambda f: [self.vocab.decode(ids.tolist()) for ids in f.ids]
      result.hypotheses = [[] if n else decoded(f) for n, f in zip(none, found)]
      result.scores = [[] if n else f.scores.tolist() for n, f in zip(none, found)]
      if token_scores:
        result.token_scores = [[] if n else list(f.token_scores) for n, f in zip(none, found)]
    return result

  def _pooled(
    self,
    ids,
    settings: SearchSettings,
    rng,
    pool_size: int,
    bar,
    scores: bool,
    token_scores: bool,
    prefixes,
  ) -> list:
    """The best translation of each of `ids` through a pool of decoding rows (continuous
    batching), in input order: its ids, or with `scores` its `model.generate.NBest` of one."""
    outputs: list = [None] * len(ids)
    found = decode_continuous(
      self.model,
      self.loaded.search_params,
      ids,
      settings,
      source_len=bucket_length(max((len(s) for s in ids), default=1)),
      rng=rng,
      pool_size=pool_size,
      ensemble=self.restored.ensemble,
      num_ids=self.vocab.vocab_size,
      token_scores=token_scores,
      programs=self._pools,
      prefixes=prefixes,
    )
    for done, h in enumerate(found, start=1):
      if scores:
        outputs[h.index] = generate.nbest(h.ids[:1], h.scores[:1], _first(h.token_scores))
      else:
        outputs[h.index] = generate.strip(h.ids[0])
      bar.update(done)
    return outputs

  @property
  def scorer(self) -> PairScorer:
    """The model's `inference.pair_scoring.PairScorer` on this translator's devices (made once)."""
    if self._scorer is None:
      self._scorer = PairScorer(
        self.model,
        self.params,
        self.vocab,
        max_len=max(self.max_len, 2),
        ensemble=self.restored.ensemble,
        batch_multiple=len(self.devices),
        place=lambda ids: jax.device_put(ids, self.loaded.rows),
      )
    return self._scorer

  def score_pairs(
    self,
    sources: Sequence[str],
    targets: Sequence[str],
    *,
    tokens_per_batch: int = 4096,
    as_search: bool = False,
  ) -> list[PairScore]:
    """Scores given translations (forced decoding, as CTranslate2's `score_batch` and fairseq's
    `--score-reference`): per pair, in input order, its log-probability (`log_prob`, EOS
    included), each target token's (`token_log_probs`) and the tokens (`tokens`). By default
    under the distribution the training loss reads (-log_prob is the pair's unsmoothed cross
    entropy); `as_search=True`: the one the searches draw from (PAD impossible).
    `inference/pair_scoring.py` has the details."""
    return self.scorer.score(
      sources, targets, tokens_per_batch=tokens_per_batch, as_search=as_search
    )

  def settings(self, settings: SearchSettings | None = None, **fields) -> SearchSettings:
    """`settings` (or this model's defaults) with `fields` changed, checked for this model:
    UsageError naming the field when one is out of range or they do not go together. The defaults
    of beam_size, alpha and max_extra_len are the training config's eval.beam_size, eval.alpha
    (decoder.yml's beam-size and normalize for an imported Marian model) and
    eval.max_decode_extra, of length_penalty its eval.length_penalty ('marian' for an import);
    a config without them (an older workdir) gets SearchSettings' own."""
    plain = SearchSettings()
    defaults = {
      "beam_size": int(self.config.eval.get("beam_size", plain.beam_size)),
      "alpha": float(self.config.eval.get("alpha", plain.alpha)),
      "max_extra_len": int(self.config.eval.max_decode_extra),
      "length_penalty": str(self.config.eval.get("length_penalty", plain.length_penalty)),
    }
    try:
      settings, unknown = with_keywords(settings, fields, defaults)
    except ValueError as e:
      raise UsageError(str(e)) from None
    if unknown:
      raise UsageError(
        f"unexpected keyword argument {sorted(unknown)[0]!r}; the search settings are "
        f"{', '.join(FIELDS)}"
      )
    vocab = int(self.config.model.vocab_size)
    if settings.top_k > vocab:
      raise UsageError(
        f"top_k={settings.top_k}: larger than the model's vocabulary ({vocab} ids); use 0 for "
        f"all of them"
      )
    return settings

  def check_options(self, **options) -> None:
    """UsageError for an option of `OPTION_RULES` out of its range."""
    for name, value in options.items():
      try:
        OPTION_RULES[name].check(value)
      except RuleError as e:
        raise UsageError(f"{name}={value!r}: {e}") from None

  def describe(self, settings: SearchSettings) -> str:
    """A line saying what decodes and how, for logs."""
    which = (
      f"an ensemble of the checkpoints of steps {', '.join(map(str, self.restored.steps))}"
      if self.restored.ensemble
      else f"checkpoint step {self.step}"
    )
    return (
      f"{self.config.model.type}, {which}, {settings.describe()}, dtype {self.dtype} "
      f"({self.dtype_reason}) on {len(self.devices)} {self.devices[0].platform} device(s)"
    )

  @staticmethod
  def metrics(hypotheses: Sequence[str], references: Sequence[str]) -> Metrics:
    """sacreBLEU corpus BLEU cased (the standard) and lowercased (as published Multi30k figures
    are), and chrF, with their signatures (`training.translation_metrics.corpus_metrics`)."""
    return corpus_metrics(hypotheses, references)

  def attention(self, translations: Translations, index: int) -> np.ndarray:
    """The encoder-decoder attention of sentence `index` of `translations` (from this model; an
    ensemble's newest member): [layers, heads, target tokens + EOS, source tokens]."""
    if not hasattr(self.model, "decode"):
      raise UsageError(
        f"model.type={self.config.model.type!r} has no encoder-decoder attention weights"
      )
    source = translations.source_ids[index]
    if source is None:
      raise UsageError(f"sentence {index} is empty: no attention to show")
    params = self.params  # as placed for decoding: int8's matrices quantized there, once
    if self.restored.ensemble:
      params = jax.tree_util.tree_map(lambda x: x[-1], params)
    return attention_weights(self.model, params, source, translations.output_ids[index])


def _first(token_scores):
  return None if token_scores is None else token_scores[:1]
