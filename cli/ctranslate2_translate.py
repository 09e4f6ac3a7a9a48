"""Translates text with an exported CTranslate2 model (inference/ctranslate2_translate.py): the
serving path on CPUs, no JAX involved.

    python -m cli.ctranslate2_translate --model=m30k_ct2 --input=test.en [--output=-] \
        [--reference=test.de] [--compute_type=int8] [--beam_size=4] [--alpha=0.6] \
        [--threads=2 | --threads=1 --inter_threads=2]

The search flags are decode.py's (cli/search_flags.py: the same names, help and defaults), but
for `--length_penalty`, whose default here is fairseq: CTranslate2 searches with that penalty
only, so the export translates as `decode.py --length_penalty=fairseq` does; and there is no
`--prefix_rule`, as this command takes no target prefix. Options it cannot honour (sampling, a
GNMT beam search, `--stopping=exact`) are refused with one line. Translations one per line in
input order (an empty line gives an empty line); with references the sacreBLEU score lines go to
stdout, or to stderr when the translations do. Exit status 2: bad usage or input; 1: a failure
while running.
"""

from __future__ import annotations

from absl import flags, logging

from cli import app
from cli.files import check_writable, read_aligned, write_lines
from cli.search_flags import define_search_flags, search_fields
from core.rules import Int
from inference.ctranslate2_translate import COMPUTE_TYPES, load, search_options, translate_texts
from model.search_settings import SearchSettings
from training.translation_metrics import corpus_metrics as score

SEARCH_DEFAULTS = {"length_penalty": "fairseq"}  # the only one CTranslate2 searches with


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
  define_search_flags(
    flag_values,
    SEARCH_DEFAULTS,
    {"length_penalty": "CTranslate2 searches with fairseq only."},
    omit=("prefix_rule",),  # this command takes no prefix
  )
  flags.DEFINE_integer(
    "threads",
    0,
    "CPU threads of each replica (intra_threads); 0 = the cores shared among the replicas.",
    **define,
  )
  flags.DEFINE_integer(
    "inter_threads",
    1,
    "Replicas translating length groups side by side (CTranslate2's inter_threads).",
    **define,
  )
  app.check_flag("threads", Int(0), flag_values)
  app.check_flag("inter_threads", Int(1), flag_values)


def main() -> None:
  f = flags.FLAGS
  options = search_options(SearchSettings(**search_fields(f)))  # before any file is read
  check_writable(f.output, "--output")
  sources, references = read_aligned(f.input, f.reference)
  translator, pieces = load(f.model, f.compute_type, f.threads, f.inter_threads)
  logging.info("translating %d sentences with %s", len(sources), f.model)
  translations = translate_texts(translator, pieces, sources, **options)
  write_lines(f.output, translations)
  if references is not None:
    score(translations, references).print_beside(f.output)


if __name__ == "__main__":
  define_flags()
  app.run(main, prog="cli.ctranslate2_translate", flag_names={"model_dir": "model"})
