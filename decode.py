"""Translates text with a trained model, and scores it against references when given: the command
line over `inference.translator.Translator`.

    python decode.py --workdir=/tmp/tiny < source.txt > translations.txt
    python decode.py --workdir=/tmp/tiny --split=test --json=test.json
    python decode.py --workdir=runs/base --input=newstest2014.en --reference=newstest2014.de \
        --checkpoint=average:5 --beam_size=4 --alpha=0.6
    python decode.py --workdir=runs/base --split=test --checkpoint=ensemble:3   # 3 models at once

Everything (parameters, config, vocabulary) comes from the workdir. Translations are written one
per line in input order; an empty input line gives an empty output line. With references the
sacreBLEU score lines go to stdout, or to stderr when the translations do. Inputs, outputs and
options are checked before anything is decoded. Exit status 2: bad usage or input; 1: a failure
while running.
"""

from __future__ import annotations

import json
import pathlib

if __name__ == "__main__":  # first, before JAX starts its threads: see cli/host_memory.py
  from cli.host_memory import keep_freed_memory_on_cpu

  keep_freed_memory_on_cpu()

from absl import flags, logging  # noqa: E402

from cli import app  # noqa: E402
from cli.files import check_writable, read_aligned, write_lines  # noqa: E402
from configs.rules import Int, check_flag  # noqa: E402
from core.errors import UsageError  # noqa: E402
from data.sources import load_split  # noqa: E402
from inference import compilation_cache  # noqa: E402
from inference.attention_plot import plot_attention, token_labels  # noqa: E402
from inference.translator import DTYPES, OPTION_RULES, Translator  # noqa: E402
from model.search import PENALTIES  # noqa: E402
from model.special_tokens import EOS_ID  # noqa: E402

_WORKDIR = flags.DEFINE_string("workdir", None, "Training workdir: checkpoints, config, vocab.")
_INPUT = flags.DEFINE_string("input", None, "Source sentences, one per line; '-' or unset = stdin.")
_OUTPUT = flags.DEFINE_string("output", "-", "Where translations go; '-' = stdout.")
_REFERENCE = flags.DEFINE_string("reference", None, "Reference translations, one per line.")
_SPLIT = flags.DEFINE_string(
  "split",
  None,
  "Translate this split of the workdir's dataset (e.g. test) and score against its references; "
  "replaces --input.",
)
_BEAM = flags.DEFINE_integer("beam_size", 4, "Beam size; 1 = greedy search.")
_ALPHA = flags.DEFINE_float("alpha", 0.6, "Length penalty exponent of beam search.")
_PENALTY = flags.DEFINE_enum(
  "length_penalty",
  "gnmt",
  list(PENALTIES),
  "The length penalty's form: gnmt (the paper's ((5+len)/6)^alpha, searching on while a live "
  "hypothesis could still win) or fairseq (len^alpha, a sentence done once beam_size hypotheses "
  "are, as fairseq and CTranslate2 search).",
)
_EXTRA = flags.DEFINE_integer(
  "max_extra_len",
  None,
  "Output length limit = source length + this (default: config.eval.max_decode_extra).",
)
_CHECKPOINT = flags.DEFINE_string(
  "checkpoint",
  "latest",
  "'latest', a step number, 'average:<k>' (the mean of the last k checkpoints' parameters) or "
  "'ensemble:<k>' (the last k checkpoints decoded together: the mean of their next-token "
  "probabilities, k times the decoding work).",
)
_JSON = flags.DEFINE_string("json", None, "Write scores and speed to this JSON file.")
_DTYPE = flags.DEFINE_enum(
  "dtype", None, list(DTYPES), "Computation dtype (default: the training config's model.dtype)."
)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "> 0: sample instead of searching.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sample from the k most likely tokens (0 = all).")
_SEED = flags.DEFINE_integer("seed", 0, "Random seed of sampling.")
_TOKENS = flags.DEFINE_integer(
  "tokens_per_batch", None, "Padded source tokens per batch (default: 512 on CPUs, else 4096)."
)
_PLOT = flags.DEFINE_string(
  "plot_attention", None, "Write a PNG of the cross-attention weights of one sentence."
)
_PLOT_SENTENCE = flags.DEFINE_integer(
  "plot_sentence", 0, "Which sentence to plot: 0-based index into the input lines (or the split)."
)
_CACHE = flags.DEFINE_string(
  "compilation_cache",
  None,
  "Folder of the persistent compilation cache, so a second run of the same model and settings "
  "compiles nothing; 'off' = none (default: $JAX_COMPILATION_CACHE_DIR, else "
  "$XDG_CACHE_HOME/attention-jax/jax or ~/.cache/attention-jax/jax).",
)
flags.mark_flag_as_required("workdir")
for _name in OPTION_RULES:  # the flags named as Translator's options follow its rules
  if _name != "length_penalty":  # an enum flag: absl checks it
    check_flag(_name, OPTION_RULES[_name])
check_flag("plot_sentence", Int(min=0))


def _texts() -> tuple[list[str] | None, list[str] | None]:
  """(sources, references) from --input/--reference; (None, None) for --split, whose text comes
  with the workdir's config. Read before any model is loaded: a bad input fails first."""
  if _SPLIT.value and _INPUT.value is not None:
    raise UsageError("give --split or --input, not both")
  if _SPLIT.value and _REFERENCE.value:
    raise UsageError("--split scores against the split's own references; drop --reference")
  if _SPLIT.value:
    return None, None
  return read_aligned(_INPUT.value, _REFERENCE.value)


def decode() -> None:
  compilation_cache.enable(_CACHE.value)  # before anything compiles
  for path, flag in (
    (_OUTPUT.value, "--output"),
    (_JSON.value, "--json"),
    (_PLOT.value, "--plot_attention"),
  ):
    check_writable(path, flag)
  sources, references = _texts()
  translator = Translator.load(_WORKDIR.value, _CHECKPOINT.value, dtype=_DTYPE.value)
  if _SPLIT.value:
    try:
      pairs, _ = load_split(translator.config.data, _SPLIT.value)
    except (ValueError, FileNotFoundError) as e:
      raise UsageError(f"--split={_SPLIT.value}: {e}") from None
    sources, references = [s for s, _ in pairs], [t for _, t in pairs]
  options = dict(
    beam_size=_BEAM.value,
    alpha=_ALPHA.value,
    length_penalty=_PENALTY.value,
    max_extra_len=_EXTRA.value,
    temperature=_TEMPERATURE.value,
    top_k=_TOP_K.value,
    seed=_SEED.value,
    tokens_per_batch=_TOKENS.value,
  )
  try:
    translator.check_options(**{k: v for k, v in options.items() if v is not None})
  except UsageError as e:
    raise UsageError(f"--{e}") from None
  plotted = _PLOT_SENTENCE.value
  if _PLOT.value and (plotted >= len(sources) or not sources[plotted].strip()):
    raise UsageError(
      f"--plot_sentence={plotted}: no such non-empty sentence (there are {len(sources)} input "
      f"lines)"
    )
  if _PLOT.value and not hasattr(translator.model, "decode"):
    raise UsageError(
      f"--plot_attention: model.type={translator.config.model.type!r} has no encoder-decoder "
      f"attention weights to plot"
    )

  empty = sum(not s.strip() for s in sources)
  logging.info(
    "Translating %d sentences (%d empty) with %s",
    len(sources) - empty,
    empty,
    translator.describe(
      _BEAM.value, _ALPHA.value, _TEMPERATURE.value, _TOP_K.value, _PENALTY.value
    ),
  )
  result = translator.run(sources, progress=True, **options)
  write_lines(_OUTPUT.value, result.texts)
  seconds = max(result.seconds, 1e-9)
  logging.info(
    "Translated %d sentences, %d tokens in %.2f s (compilation included): %.1f sentences/s, "
    "%.1f tokens/s",
    result.sentences,
    result.tokens,
    seconds,
    result.sentences / seconds,
    result.tokens / seconds,
  )

  scores = {"bleu": None, "bleu_lowercase": None, "chrf": None}
  if references is not None:
    scored = translator.score(result.texts, references)
    scores = scored.as_dict()
    scored.print_beside(_OUTPUT.value)

  if _JSON.value:
    summary = dict(
      scores,
      sentences=result.sentences,
      sent_per_s=result.sentences / seconds,
      tokens_per_s=result.tokens / seconds,
      beam_size=_BEAM.value,
      alpha=_ALPHA.value,
      length_penalty=_PENALTY.value,
      checkpoint_step=int(translator.step),
      checkpoint=_CHECKPOINT.value,
      checkpoint_steps=[int(s) for s in translator.restored.steps],
    )
    try:
      pathlib.Path(_JSON.value).write_text(json.dumps(summary, indent=2) + "\n")
    except OSError as e:
      raise UsageError(f"--json={_JSON.value}: cannot write: {e.strerror or e}") from None

  if _PLOT.value:
    weights = translator.attention(result, plotted)
    target = list(result.output_ids[plotted]) + [EOS_ID]
    plot_attention(
      _PLOT.value,
      weights,
      token_labels(translator.vocab, result.source_ids[plotted]),
      token_labels(translator.vocab, target),
      f"sentence {plotted} (line {plotted + 1}): last layer cross-attention, "
      f"step {translator.step}",
    )
    logging.info("Wrote the attention plot of sentence %d to %s", plotted, _PLOT.value)


if __name__ == "__main__":
  app.run(decode, prog="decode.py")
