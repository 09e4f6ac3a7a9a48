"""An exported CTranslate2 model (inference/ctranslate2_export.py) loaded for translating: the
serving path on CPUs, no JAX involved (the command line: cli/ctranslate2_translate.py).

    translator, pieces = load("m30k_ct2", compute_type="int8")  # one replica, every core
    translator, pieces = load("m30k_ct2", threads=1, inter_threads=2)  # two, one core each
    options = search_options(SearchSettings(beam_size=5, alpha=1.0, length_penalty="fairseq"))
    texts = translate_texts(translator, pieces, lines, **options)

The export directory holds the vocabulary (vocab.model) beside CTranslate2's files, so it is all
this needs; `search_options` refuses the settings CTranslate2 cannot search as we do.

Lengths: a source longer than the model's `max_len` (the export's limits.json) is cut to it as
decode.py cuts it; ours stops a sentence at (source tokens with EOS + max_extra_len) tokens, EOS
included; CTranslate2's `max_decoding_length` counts tokens without EOS and applies to a whole batch
(`max_decoding_length`, `translate_tokens` batches sentences by length), and its default
min_decoding_length of 1 would forbid an empty translation (passed as 0 here).

Beam search: CTranslate2 (4.8) scores a finished hypothesis logp / len**length_penalty, len
counting its EOS (`return_end_token` changes only what is returned), and stops a sentence as soon
as beam_size * patience hypotheses have finished, and at the length limit finishes the top
beam_size candidates of the last step with their last token: our search with
`length_penalty='fairseq'` (`decode.py --length_penalty=fairseq`, patience 1) does the same and
gives the same translations.
Our default, GNMT's logp / ((5 + len) / 6)**alpha searching on while a live hypothesis could still
win (model/search.py), agrees with it at alpha = length_penalty = 0 and greedily.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Sequence

from core.errors import ArgumentError, RunError, UsageError
from data.tokenizer import (
  VOCAB_JSON_NAME,
  VOCAB_MODEL_NAME,
  Vocab,
  encode_source,
  load_vocab,
  warn_cut,
)
from model.search_settings import SearchSettings
from model.special_tokens import UNK_ID

QUANTIZATIONS = (
  "float32",
  "int8",
  "int8_float32",
  "int8_float16",
  "int8_bfloat16",
  "int16",
  "float16",
  "bfloat16",
)
# What a translator can compute in (its `compute_type`): a storage type, or its own choice.
COMPUTE_TYPES = ("default", "auto", *QUANTIZATIONS)
# Our file in an export directory with the longest source the model takes ({"max_len": tokens,
# EOS included}: config.model.max_len), which CTranslate2's own files do not carry.
LIMITS_NAME = "limits.json"


def import_ctranslate2():
  """The optional `ctranslate2` package, or a UsageError saying how to install it."""
  try:
    import ctranslate2
  except ImportError:
    raise UsageError(
      "CTranslate2 is not installed: pip install 'attention-jax[ctranslate2]' (or ctranslate2)"
    ) from None
  return ctranslate2


def load(model_dir, compute_type: str = "default", threads: int = 0, inter_threads: int = 1):
  """(ctranslate2.Translator, Pieces) of an export directory: `inter_threads` replicas (batches
  translated side by side), each on `threads` threads (0 = the cores shared among the
  replicas, at least one each). Which matrix library it multiplies with is CTranslate2's choice
  at import (MKL on Intel CPUs, oneDNN elsewhere; `CT2_USE_MKL=0` in the environment before
  `ctranslate2` is imported forces oneDNN; `CT2_VERBOSE=1` prints the choice)."""
  if inter_threads < 1 or threads < 0:
    raise ArgumentError(
      "inter_threads" if inter_threads < 1 else "threads",
      inter_threads if inter_threads < 1 else threads,
      "must be positive (threads: 0 = the cores shared among the replicas)",
    )
  path = pathlib.Path(model_dir)
  if not (path / "model.bin").is_file():
    raise ArgumentError(
      "model_dir", model_dir, "no model.bin; export one with python -m cli.ctranslate2_export"
    )
  vocab_files = [
    path / name for name in (VOCAB_MODEL_NAME, VOCAB_JSON_NAME) if (path / name).is_file()
  ]
  if not vocab_files:
    raise ArgumentError(
      "model_dir", model_dir, f"no {VOCAB_MODEL_NAME} or {VOCAB_JSON_NAME} beside the model"
    )
  max_len = read_max_len(path)
  ctranslate2 = import_ctranslate2()
  try:
    translator = ctranslate2.Translator(
      str(path),
      device="cpu",
      compute_type=compute_type,
      inter_threads=inter_threads,
      intra_threads=threads or max(1, (os.cpu_count() or 1) // inter_threads),
    )
  except ValueError as e:  # a compute type this CPU or build cannot run
    raise ArgumentError("compute_type", compute_type, " ".join(str(e).split())) from None
  except RuntimeError as e:  # a damaged model directory
    raise RunError(f"{model_dir}: cannot load the model: {' '.join(str(e).split())}") from None
  return translator, Pieces(load_vocab(vocab_files[0]), max_len)


def read_max_len(model_dir) -> int | None:
  """The longest source the exported model takes (`LIMITS_NAME`), or None for a directory
  exported before it was written (sources then go whole)."""
  path = pathlib.Path(model_dir) / LIMITS_NAME
  if not path.is_file():
    return None
  try:
    max_len = json.loads(path.read_text())["max_len"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise RunError(f"{path}: cannot read the model's max_len: {e}") from None
  if not isinstance(max_len, int) or max_len < 2:
    raise RunError(f"{path}: max_len={max_len!r} is not a length of at least 2 tokens")
  return max_len


def search_options(settings: SearchSettings) -> dict:
  """`translate_texts`' search options for `settings`; an ArgumentError naming the field that
  CTranslate2 cannot honour as we search: sampling (its own generator and distribution),
  several hypotheses per sentence (one is returned), and the GNMT length penalty or the exact
  stopping rule of a beam search (CTranslate2 divides by len^alpha and stops a sentence once
  `beam_size` hypotheses have finished: our 'fairseq' and 'finished')."""
  if settings.sampling:
    raise ArgumentError(
      "temperature", settings.temperature, "sampling is decode.py's only (CTranslate2 searches)"
    )
  if settings.num_hypotheses != 1:
    raise ArgumentError("num_hypotheses", settings.num_hypotheses, "CTranslate2 gives one here")
  if settings.beam_size > 1 and settings.length_penalty != "fairseq":
    raise ArgumentError(
      "length_penalty",
      settings.length_penalty,
      "CTranslate2's beam search has the fairseq length penalty only (len^alpha)",
    )
  if settings.beam_size > 1 and settings.stopping_rule != "finished":
    raise ArgumentError(
      "stopping",
      settings.stopping,
      "CTranslate2's beam search stops once beam_size hypotheses have finished only",
    )
  return {
    "beam_size": settings.beam_size,
    "length_penalty": settings.alpha,
    "max_extra_len": settings.max_extra_len,
  }


class Pieces:
  """Our vocabulary as CTranslate2's tokens: `source(text)` is the token list `translate_batch`
  takes for a sentence (our ids' pieces, without EOS: the model adds it; cut as decode.py cuts
  it to `max_len` tokens with EOS, when given), `text(tokens)` the text of a hypothesis,
  `ids(tokens)` its ids."""

  def __init__(self, vocab: Vocab, max_len: int | None = None):
    self.vocab, self.max_len = vocab, max_len
    self.pieces = [vocab.piece(i) for i in range(vocab.vocab_size)]
    self._ids = {piece: i for i, piece in enumerate(self.pieces)}
    if len(self._ids) != len(self.pieces):
      raise UsageError("the vocabulary has repeated pieces; CTranslate2 maps tokens by piece")

  def source(self, text: str) -> list[str]:
    return self.sources([text])[0][0]

  def sources(self, texts: Sequence[str]) -> tuple[list[list[str]], list[int]]:
    """(`source` of each text, the indices of those cut to `max_len`)."""
    out, cut = [], []
    for n, text in enumerate(texts):
      if self.max_len is None:
        ids = self.vocab.encode(text)
      else:
        ids, was_cut = encode_source(self.vocab, text, self.max_len)
        ids = ids[:-1]  # without its EOS
        if was_cut:
          cut.append(n)
      out.append([self.pieces[i] for i in ids])
    return out, cut

  def ids(self, tokens: Sequence[str]) -> list[int]:
    return [self._ids.get(t, UNK_ID) for t in tokens]

  def text(self, tokens: Sequence[str]) -> str:
    return self.vocab.decode(self.ids(tokens))


def max_decoding_length(source_tokens: int, max_extra_len: int) -> int:
  """CTranslate2's `max_decoding_length` for our limit on a sentence of `source_tokens` tokens
  (without EOS): ours allows source tokens + EOS + max_extra_len tokens counting its own EOS,
  CTranslate2 counts tokens without EOS."""
  return max(1, source_tokens + max_extra_len)


def translate_tokens(
  translator,
  sources: Sequence[Sequence[str]],
  *,
  max_extra_len: int = 50,
  target_prefixes: Sequence[Sequence[str]] | None = None,
  **options,
) -> list[list[str]]:
  """The best hypothesis of each source (token lists, `Pieces.source`) from
  `translator.translate_batch(..., **options)`, with our per-sentence length limit: sentences of
  one length are translated together, at that length's `max_decoding_length` (all lengths queued
  at once, so a translator with several replicas, `inter_threads`, translates them side by side;
  each sentence's translation is the same either way); an empty translation is allowed
  (min_decoding_length 0), as in ours. `target_prefixes`: a token list per source (empty: none),
  CTranslate2's `target_prefix`. Input order."""
  options.setdefault("min_decoding_length", 0)  # CTranslate2's default 1 forbids EOS first
  options.setdefault("max_input_length", 0)  # no truncation (its default: 1024 tokens)
  by_length: dict[int, list[int]] = {}
  for i, tokens in enumerate(sources):
    by_length.setdefault(len(tokens), []).append(i)
  out: list[list[str]] = [[] for _ in sources]
  pending = []
  for length, indices in sorted(by_length.items()):
    prefixes = None
    if target_prefixes is not None:
      prefixes = [list(target_prefixes[i]) or None for i in indices]
    results = translator.translate_batch(
      [list(sources[i]) for i in indices],
      target_prefix=prefixes,
      max_decoding_length=max_decoding_length(length, max_extra_len),
      asynchronous=True,  # every group queued at once: a translator's replicas share them
      **options,
    )
    pending.append((indices, results))
  for indices, results in pending:
    for i, result in zip(indices, results):
      out[i] = list(result.result().hypotheses[0])
  return out


def translate_texts(translator, pieces: Pieces, texts: Sequence[str], **options) -> list[str]:
  """`translate_tokens` from text to text through our vocabulary; sources longer than the
  model's `max_len` are cut to it with a warning naming their lines, as decode.py does."""
  sources, cut = pieces.sources(texts)
  warn_cut([i + 1 for i in cut], len(texts), pieces.max_len)
  hypotheses = translate_tokens(translator, sources, **options)
  return [pieces.text(tokens) for tokens in hypotheses]
