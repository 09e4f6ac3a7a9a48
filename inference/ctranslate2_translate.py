"""Translates text with an exported CTranslate2 model (inference/ctranslate2_export.py): the
serving path on CPUs, no JAX involved.

    python -m inference.ctranslate2_translate --model=m30k_ct2 --input=test.en [--output=-] \
        [--reference=test.de] [--compute_type=int8] [--beam_size=4] [--alpha=0.6]

The export directory holds the vocabulary (vocab.model) beside CTranslate2's files, so it is all
this needs. Search as decode.py's `--length_penalty=fairseq`: the best of `beam_size`
hypotheses by logp / len^alpha, a sentence done once `beam_size` have finished, at most (source
tokens + EOS + `max_extra_len`) tokens. Translations one per line in input order (an empty line
gives an empty line); with references the sacreBLEU score lines go to stdout, or to stderr when
the translations do. Exit status 2: bad usage or input; 1: a failure while running.
"""

from __future__ import annotations

import os
import pathlib

from absl import flags, logging

from cli import app
from cli.files import check_writable, read_aligned, write_lines
from configs.rules import Float, Int, check_flag
from core.errors import ArgumentError, RunError
from data.tokenizer import VOCAB_JSON_NAME, VOCAB_MODEL_NAME, load_vocab
from inference.ctranslate2_export import (
  COMPUTE_TYPES,
  Pieces,
  import_ctranslate2,
  translate_texts,
)
from inference.scores import score


def load(model_dir, compute_type: str = "default", threads: int = 0):
  """(ctranslate2.Translator, Pieces) of an export directory; `threads` 0 = all cores."""
  path = pathlib.Path(model_dir)
  if not (path / "model.bin").is_file():
    raise ArgumentError(
      "model_dir", model_dir, "no model.bin; export one with inference.ctranslate2_export"
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
      inter_threads=1,
      intra_threads=threads or os.cpu_count() or 1,
    )
  except ValueError as e:  # a compute type this CPU or build cannot run
    raise ArgumentError("compute_type", compute_type, " ".join(str(e).split())) from None
  except RuntimeError as e:  # a damaged model directory
    raise RunError(f"{model_dir}: cannot load the model: {' '.join(str(e).split())}") from None
  return translator, Pieces(load_vocab(vocab_files[0]))


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """This command line's flags, defined only when it runs (cli/app.py)."""
  define = dict(flag_values=flag_values)
  flags.DEFINE_string("model", None, "Export directory.", required=True, **define)
  flags.DEFINE_string(
    "input", None, "Source sentences, one per line; '-' or unset = stdin.", **define
  )
  flags.DEFINE_string("output", "-", "Where translations go; '-' = stdout.", **define)
  flags.DEFINE_string("reference", None, "Reference translations, one per line.", **define)
  flags.DEFINE_enum(
    "compute_type",
    "default",
    list(COMPUTE_TYPES),
    "CTranslate2's compute type (default: as saved).",
    **define,
  )
  flags.DEFINE_integer("beam_size", 4, "Beam size; 1 = greedy search.", **define)
  flags.DEFINE_float("alpha", 1.0, "Length penalty exponent: logp / len^alpha.", **define)
  flags.DEFINE_integer("max_extra_len", 50, "Output tokens allowed beyond the source's.", **define)
  flags.DEFINE_integer("threads", 0, "CPU threads; 0 = all cores.", **define)
  for name, rule in [
    ("beam_size", Int(1)),
    ("alpha", Float(0.0)),
    ("max_extra_len", Int(0)),
    ("threads", Int(0)),
  ]:
    check_flag(name, rule, flag_values)


def main() -> None:
  f = flags.FLAGS
  check_writable(f.output, "--output")
  sources, references = read_aligned(f.input, f.reference)
  translator, pieces = load(f.model, f.compute_type, f.threads)
  logging.info("translating %d sentences with %s", len(sources), f.model)
  translations = translate_texts(
    translator,
    pieces,
    sources,
    beam_size=f.beam_size,
    length_penalty=f.alpha,
    max_extra_len=f.max_extra_len,
  )
  write_lines(f.output, translations)
  if references is not None:
    score(translations, references).print_beside(f.output)


if __name__ == "__main__":
  define_flags()
  app.run(main, prog="inference.ctranslate2_translate", flag_names={"model_dir": "model"})
