"""Translation from Python: load a trained workdir once, then translate lists of sentences and
score them.

    from inference import Translator
    translator = Translator.load("runs/m30k_tiny_ende", checkpoint="average:5")
    translator.translate(["A man is riding a bicycle."], beam_size=5, alpha=1.5)
    translator.score(hypotheses, references)   # sacreBLEU cased and lowercased, chrF

Sentences are plain text: the vocabulary tokenizes them (EOS appended), batches of similar
length are decoded together, and the outputs are detokenized in input order. An empty sentence
translates to an empty string; one longer than the model takes (`model.max_len` tokens) is cut,
with a warning naming how many were. decode.py is the command line over this module.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from configs.rules import Choice, Int, RuleError
from core.cpu import native_dtype
from core.errors import UsageError
from core.progress import Progress
from data.tokenizer import encode_source
from inference.compilation_cache import enable as enable_compilation_cache
from inference.program_store import ProgramStore
from inference.restore import Restored, load_for_inference
from inference.scores import Scores, score
from inference.scoring import PairScore, PairScorer
from model import continuous, generate
from model.batching import bucket_length
from model.build import build_model
from model.search import length_penalty
from model.search_settings import FIELDS, SearchSettings
from model.special_tokens import EOS_ID

# What `run`'s options besides the search settings may be; decode.py checks its flags of the same
# names with these (the search settings check themselves: model/search_settings.py).
OPTION_RULES = {
  "seed": Int(),
  "tokens_per_batch": Int(min=1),
  "batching": Choice("length", "continuous"),
  "pool_size": Int(min=1),
}
DTYPES = ("auto", "float32", "bfloat16")  # auto: core/cpu.py's choice for the devices
# Padded source tokens per batch by default, per platform. On CPUs small batches win: a batch
# runs until its slowest sentence ends, and a larger one gains little per step there (Multi30k
# test, beam 5: 4096 -> 512 tokens took decoding from 27.7 to 16.3 s in float32, 21.6 to 12.7 s
# in bfloat16; docs/experiments.md, "Decoding speed").
TOKENS_PER_BATCH = {"cpu": 512, "gpu": 4096, "tpu": 4096}
PROGRAMS = "programs"  # the subfolder of the compilation cache where compiled searches are kept


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

  Make one with `Translator.load(workdir, checkpoint)`. `devices`: where to decode; None = every
  local device of an accelerator (batches split over them), or one CPU device (several CPU
  devices share the same cores). `dtype='bfloat16'` decodes with bfloat16 matrices and float32
  sums: on CPUs with bfloat16 matrix units 1.3-1.6x the sentences per second of float32, the
  translations nearly all the same (docs/experiments.md, "Decoding speed"); on CPUs without them
  slower than float32. `dtype='auto'` (the default) chooses by the devices (core/cpu.py), None
  takes the training config's model.dtype; `dtype_reason` says why the dtype is what it is.

  `programs`: an `inference.program_store.ProgramStore` the searches' compiled programs come
  from and go to (`Translator.load(..., compilation_cache=...)` makes one), on one device only.

  Loading changes no logger: `inference.quiet_library_logs()` hides, as the command lines do, the
  library warnings that describe expected states (Orbax's on restoring a checkpoint without
  metadata), below absl verbosity 2.
  """

  def __init__(
    self, restored: Restored, *, dtype: str | None = "auto", devices=None, programs=None
  ):
    if dtype is not None and dtype not in DTYPES:
      raise UsageError(f"dtype={dtype!r}: expected one of {', '.join(DTYPES)}")
    self.restored = restored
    self.config = restored.config
    self.vocab = restored.vocab
    self.devices = list(devices) if devices is not None else _default_devices()
    model_cfg = self.config.model.copy_and_resolve_references()
    self.dtype_reason = "as asked" if dtype is not None else "the training config's model.dtype"
    if dtype == "auto":
      dtype, self.dtype_reason = native_dtype(self.devices[0].platform)
    if dtype is not None:
      model_cfg.dtype = dtype
    self.dtype = model_cfg.dtype
    self.model = build_model(model_cfg)
    mesh = Mesh(np.asarray(self.devices), ("batch",))
    self._rows = NamedSharding(mesh, PartitionSpec("batch"))
    self.params = jax.device_put(restored.params, NamedSharding(mesh, PartitionSpec()))
    self._scorer = None
    self.generator = generate.Generator(
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
  ):
    """From a training workdir alone: `checkpoint` is 'latest', a step number, 'average:<k>'
    (the mean of the last k checkpoints' parameters) or 'ensemble:<k>' (the last k decoded
    together). `compilation_cache`: True (the per-user folder of compilation_cache.py) or a
    folder turns on JAX's persistent compilation cache for the whole process, and keeps this
    translator's search programs in its `programs` subfolder (inference/program_store.py), so
    that a later process decoding the same model and settings neither compiles nor traces its
    searches; 'off' turns both off. JAX's cache takes effect only before the process's first
    compilation."""
    programs = None
    if compilation_cache is not False and compilation_cache is not None:
      where = enable_compilation_cache(
        None if compilation_cache is True else str(compilation_cache)
      )
      programs = None if where is None else ProgramStore(where / PROGRAMS)
    restored = load_for_inference(workdir, checkpoint)
    return cls(restored, dtype=dtype, devices=devices, programs=programs)

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
    **search,
  ) -> Translations:
    """Translates `sentences` with `settings`, or with the fields of `SearchSettings` given as
    keywords (beam_size=5, alpha=1.0, length_penalty='fairseq', max_extra_len, temperature,
    top_k; see model/search_settings.py); `max_extra_len` defaults to the training config's
    eval.max_decode_extra. `seed` draws the samples. Batches hold `tokens_per_batch` padded
    source tokens (default `TOKENS_PER_BATCH` of the devices' platform). `progress`: a progress
    bar on stderr when it is a terminal. `num_hypotheses=k` (a search setting) returns each
    sentence's k best with their scores, as `return_scores` does for one; `return_token_scores`
    adds each one's per-token log-probabilities (`Translations`): the model's, under the
    distribution the search drew from, taken by scoring the hypotheses (`score_pairs`).
    `first_line`: the line number of the first sentence, in warnings (a chunk of a stream).
    `batching='continuous'`: the sentences go through a pool of `pool_size` decoding rows, each
    sentence entering as soon as one leaves (model/continuous.py), instead of batches of similar
    length decoded until their longest sentence ends; the same translations in float32 (samples
    are drawn per sentence instead). It decodes on one device, the best hypothesis only: with
    several devices or `num_hypotheses` > 1, length batches are used."""
    if isinstance(sentences, str):
      raise UsageError("translate: expected a list of sentences, got one string")
    settings = self.settings(settings, **search)
    if tokens_per_batch is None:
      tokens_per_batch = TOKENS_PER_BATCH.get(self.devices[0].platform, TOKENS_PER_BATCH["gpu"])
    self.check_options(
      seed=seed, tokens_per_batch=tokens_per_batch, batching=batching, pool_size=pool_size
    )
    source_ids, cut = self.encode(sentences)
    if cut:
      logging.warning(
        "%d of %d sentences are longer than model.max_len=%d tokens (EOS included) and were "
        "truncated to it: line %s",
        len(cut),
        len(sentences),
        self.max_len,
        _listed([i + first_line for i in cut]),
      )
    present = [i for i, ids in enumerate(source_ids) if ids is not None]
    bar = Progress(len(present), 0, unit="sentences", enabled=progress)
    start = time.perf_counter()
    ids = [source_ids[i] for i in present]
    if batching == "continuous" and len(self.devices) == 1 and settings.num_hypotheses == 1:
      outputs = self._pooled(ids, settings, jax.random.key(seed), pool_size, bar)
    else:
      outputs = self.generator.translate_all(
        self.params,
        ids,
        settings,
        rng=jax.random.key(seed),
        tokens_per_batch=tokens_per_batch,
        batch_multiple=len(self.devices),
        place=lambda inputs: jax.device_put(inputs, self._rows),
        on_batch=bar.update,
      )
    seconds = time.perf_counter() - start
    bar.close()
    nbest: list[list[np.ndarray]] = [[] for _ in source_ids]
    for i, ids in zip(present, outputs):
      nbest[i] = [ids] if settings.num_hypotheses == 1 else ids
    output_ids = [found[0] if found else None for found in nbest]
    texts = ["" if ids is None else self.vocab.decode(ids.tolist()) for ids in output_ids]
    result = Translations(texts, source_ids, output_ids, cut, seconds)
    if settings.num_hypotheses > 1 or return_scores or return_token_scores:
      self._add_scores(result, nbest, settings, return_token_scores)
      result.seconds = time.perf_counter() - start
    return result

  def _pooled(self, ids, settings: SearchSettings, rng, pool_size: int, bar) -> list[np.ndarray]:
    """The best translation of each of `ids` through a pool of decoding rows (continuous
    batching), in input order."""
    outputs: list[np.ndarray | None] = [None] * len(ids)
    found = continuous.decode_continuous(
      self.model,
      self.params,
      ids,
      settings,
      source_len=bucket_length(max((len(s) for s in ids), default=1)),
      rng=rng,
      pool_size=pool_size,
      ensemble=self.restored.ensemble,
      num_ids=self.vocab.vocab_size,
    )
    for done, hypotheses in enumerate(found, start=1):
      outputs[hypotheses.index] = generate.strip(hypotheses.ids[0])
      bar.update(done)
    return outputs

  def _add_scores(self, result: Translations, nbest, settings: SearchSettings, tokens: bool):
    """Fills `result`'s hypotheses and scores (and token scores) for the hypotheses `nbest`."""
    pairs = [(i, ids) for i, found in enumerate(nbest) for ids in found]
    scored = self.scorer.score_ids(
      [result.source_ids[i] for i, _ in pairs],
      [[*ids.tolist(), EOS_ID] for _, ids in pairs],
      as_search=True,
    )
    result.hypotheses = [[self.vocab.decode(ids.tolist()) for ids in found] for found in nbest]
    result.scores = [[] for _ in nbest]
    result.token_scores = [[] for _ in nbest] if tokens else None
    beam = settings.beam_size > 1 and not settings.sampling
    for (i, _), pair in zip(pairs, scored):
      token_logp = pair.token_log_probs.copy()
      if len(pair.ids) >= len(result.source_ids[i]) + settings.max_extra_len:
        token_logp[-1] = 0.0  # EOS at the length limit: forced, free, as the search counts it
      logp = float(np.sum(token_logp, dtype=np.float64))
      penalty = length_penalty(len(pair.ids), settings.alpha, settings.length_penalty)
      result.scores[i].append(logp / float(penalty) if beam else logp)
      if tokens:
        result.token_scores[i].append(token_logp)

  @property
  def scorer(self) -> PairScorer:
    """The model's `inference.scoring.PairScorer` on this translator's devices (made once)."""
    if self._scorer is None:
      self._scorer = PairScorer(
        self.model,
        self.params,
        self.vocab,
        max_len=max(self.max_len, 2),
        ensemble=self.restored.ensemble,
        batch_multiple=len(self.devices),
        place=lambda ids: jax.device_put(ids, self._rows),
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
    `inference/scoring.py` has the details."""
    return self.scorer.score(
      sources, targets, tokens_per_batch=tokens_per_batch, as_search=as_search
    )

  def settings(self, settings: SearchSettings | None = None, **fields) -> SearchSettings:
    """`settings` (or this model's defaults) with `fields` changed, checked for this model:
    UsageError naming the field when one is out of range or they do not go together. The default
    max_extra_len is the training config's eval.max_decode_extra."""
    try:
      if settings is None:
        fields.setdefault("max_extra_len", int(self.config.eval.max_decode_extra))
        settings = SearchSettings(**fields)
      elif fields:
        settings = settings.replace(**fields)
    except TypeError as e:  # an unknown keyword
      raise UsageError(f"{e}; the search settings are {', '.join(FIELDS)}") from None
    except ValueError as e:
      raise UsageError(str(e)) from None
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
  def score(hypotheses: Sequence[str], references: Sequence[str]) -> Scores:
    """sacreBLEU corpus BLEU cased (the standard) and lowercased (as published Multi30k figures
    are), and chrF, with their signatures."""
    return score(hypotheses, references)

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
    params = self.restored.params
    if self.restored.ensemble:
      params = jax.tree_util.tree_map(lambda x: x[-1], params)
    return generate.attention_weights(self.model, params, source, translations.output_ids[index])


def _default_devices() -> list:
  devices = jax.local_devices()
  return devices[:1] if devices[0].platform == "cpu" else devices


def _listed(numbers: list[int], limit: int = 20) -> str:
  shown = ", ".join(map(str, numbers[:limit]))
  return shown + (f" and {len(numbers) - limit} more" if len(numbers) > limit else "")
