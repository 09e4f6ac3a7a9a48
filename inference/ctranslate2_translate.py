"""An exported CTranslate2 model (inference/ctranslate2_export.py) loaded for translating: the
serving path on CPUs, no JAX involved (the command line: cli/ctranslate2_translate.py).

    translator, pieces = load("m30k_ct2", compute_type="int8")  # one replica, every core
    translator, pieces = load("m30k_ct2", threads=1, inter_threads=2)  # two, one core each
    options = search_options(SearchSettings(beam_size=5, alpha=1.0, length_penalty="fairseq"))
    texts = translate_texts(translator, pieces, lines, **options)

The export directory holds the vocabulary (vocab.model) beside CTranslate2's files, so it is all
this needs. CTranslate2 searches as our `length_penalty='fairseq'`: the best of `beam_size`
hypotheses by logp / len^alpha, a sentence done once `beam_size` have finished, at most (source
tokens + EOS + `max_extra_len`) tokens; `search_options` refuses the settings it cannot honour.
"""

from __future__ import annotations

import os
import pathlib

from core.errors import ArgumentError, RunError
from data.tokenizer import VOCAB_JSON_NAME, VOCAB_MODEL_NAME, load_vocab
from inference.ctranslate2_export import Pieces, import_ctranslate2
from model.search_settings import SearchSettings


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
  return translator, Pieces(load_vocab(vocab_files[0]))


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
