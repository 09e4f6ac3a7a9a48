"""decode.py's command line: its flags, the checks of its inputs and outputs (before any model is
loaded), and its main, which reads the text, translates it through `inference.Translator` (or
scores given translations), and writes translations, n-best lists, scores, JSON and plots.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import sys

from absl import flags, logging

from cli import app
from cli.files import check_lines, check_writable, iter_lines, read_aligned, read_lines, write_lines
from cli.search_flags import define_search_flags, search_fields
from core.errors import UsageError
from core.rules import Int
from inference.phases import Phases
from inference.translator import DTYPES, OPTION_RULES, Translator
from model.search_settings import SearchSettings
from model.special_tokens import EOS_ID

# None: the training config's eval.beam_size, eval.alpha, eval.max_decode_extra,
# eval.length_penalty.
SEARCH_DEFAULTS = {"beam_size": None, "alpha": None, "max_extra_len": None, "length_penalty": None}
# The library's argument names -> this command line's flags.
FLAG_NAMES = {"num_hypotheses": "nbest"}
FLAGS = flags.FLAGS


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """This command line's flags, defined only when it runs (cli/app.py). The search settings'
  flags are SearchSettings' fields: their names, defaults and help (model/search_settings.py)."""
  _define_text_flags(flag_values)
  define_search_flags(  # --nbest below is num_hypotheses
    flag_values,
    SEARCH_DEFAULTS,
    {
      "beam_size": "(default: config.eval.beam_size: 4, decoder.yml's for an import)",
      "alpha": "(default: config.eval.alpha: 0.6, decoder.yml's normalize for an import)",
      "max_extra_len": "(default: config.eval.max_decode_extra)",
      "length_penalty": "(default: config.eval.length_penalty: gnmt, marian for an import)",
    },
  )
  _define_model_flags(flag_values)
  _define_output_flags(flag_values)
  _define_batching_flags(flag_values)
  flags.mark_flag_as_required("workdir", flag_values=flag_values)
  for name, rule in OPTION_RULES.items():  # the flags named as Translator's options
    app.check_flag(name, rule, flag_values)
  app.check_flag("plot_sentence", Int(min=0), flag_values)
  app.check_flag("nbest", Int(min=0), flag_values)
  app.check_flag("stream_lines", Int(min=1), flag_values)


def _define_text_flags(flag_values: flags.FlagValues) -> None:
  """Where the text comes from and goes to."""
  f = dict(flag_values=flag_values)
  flags.DEFINE_string("workdir", None, "Training workdir: checkpoints, config, vocab.", **f)
  flags.DEFINE_string("input", None, "Source sentences, one per line; '-' or unset = stdin.", **f)
  flags.DEFINE_string("output", "-", "Where translations go; '-' = stdout.", **f)
  flags.DEFINE_string("reference", None, "Reference translations, one per line.", **f)
  flags.DEFINE_string(
    "target_prefix",
    None,
    "Target prefixes, one per input line (empty line = none): each translation starts with its "
    "line's prefix and the search goes on from there.",
    **f,
  )
  flags.DEFINE_string(
    "split",
    None,
    "Translate this split of the workdir's dataset (e.g. test) and score against its "
    "references; replaces --input.",
    **f,
  )


def _define_model_flags(flag_values: flags.FlagValues) -> None:
  """Which parameters, in which dtype, with which compiled programs."""
  f = dict(flag_values=flag_values)
  flags.DEFINE_string(
    "checkpoint",
    "latest",
    "'latest', a step number, 'average:<k>' (the mean of the last k checkpoints' parameters) or "
    "'ensemble:<k>' (the last k checkpoints decoded together: the mean of their next-token "
    "probabilities, k times the decoding work).",
    **f,
  )
  flags.DEFINE_string("json", None, "Write scores and speed to this JSON file.", **f)
  flags.DEFINE_enum(
    "dtype",
    "auto",
    list(DTYPES),
    "Computation dtype; auto: bfloat16 where the devices multiply it faster (GPUs, TPUs, CPUs "
    "with AMX, AMD's with AVX512-BF16), else float32 (core/cpu.py); int8: int8 products from "
    "matrices quantized per output channel, as CTranslate2's int8 (Transformer models).",
    **f,
  )
  flags.DEFINE_string(
    "compilation_cache",
    None,
    "Folder of the persistent compilation cache, of the compiled searches and of copies of the "
    "parameters read, so a second run of the same model and settings compiles and traces "
    "nothing and reads the parameters without Orbax; 'off' = none (default: "
    "$JAX_COMPILATION_CACHE_DIR, else $XDG_CACHE_HOME/attention-jax/jax or "
    "~/.cache/attention-jax/jax).",
    **f,
  )


def _define_output_flags(flag_values: flags.FlagValues) -> None:
  """What is written besides the translations: n-best lists, scores of given pairs, plots."""
  f = dict(flag_values=flag_values)
  flags.DEFINE_integer(
    "nbest",
    0,
    "> 0: write each sentence's k best hypotheses (at most --beam_size) as "
    "'index ||| hypothesis ||| score' lines (Moses / fairseq), the score as the search ranks "
    "them (log-probability over the length penalty).",
    **f,
  )
  flags.DEFINE_bool(
    "score_reference",
    False,
    "Score the references instead of translating (forced decoding): each pair's line is "
    "'log-probability ||| per-token log-probabilities' (EOS last), natural log, in input order.",
    **f,
  )
  flags.DEFINE_string(
    "plot_attention", None, "Write a PNG of the cross-attention weights of one sentence.", **f
  )
  flags.DEFINE_integer(
    "plot_sentence",
    0,
    "Which sentence to plot: 0-based index into the input lines (or the split).",
    **f,
  )


def _define_batching_flags(flag_values: flags.FlagValues) -> None:
  """How the sentences are cut into batches and read."""
  f = dict(flag_values=flag_values)
  flags.DEFINE_integer(
    "stream_lines",
    10_000,
    "Lines of --input (or piped stdin) translated at a time when no reference, split or plot "
    "needs them all: memory stays bounded and outputs are written as they are ready (typed "
    "lines are translated one by one).",
    **f,
  )
  flags.DEFINE_enum(
    "batching",
    "length",
    ["length", "continuous"],
    "length: batches of similar length, each decoded until its longest sentence ends; "
    "continuous: a pool of --pool_size rows, a sentence entering as soon as one leaves "
    "(one device; the same translations in float32).",
    **f,
  )
  flags.DEFINE_integer("pool_size", 32, "Decoding rows of --batching=continuous.", **f)
  flags.DEFINE_integer(
    "parallel_batches",
    None,
    "Length batches decoded at once, each by its own thread (the same translations whatever it "
    "is); default: one more than the CPU cores this process may use on one CPU device, else 1.",
    **f,
  )
  flags.DEFINE_integer("seed", 0, "Random seed of sampling.", **f)
  flags.DEFINE_integer(
    "tokens_per_batch",
    None,
    "Padded source tokens per batch (default: 512 on CPUs, else 4096; on a CPU a beam search of "
    "one model without prefixes keeps its batches to 512 tokens and 16 sentences at most).",
    **f,
  )


def _search_fields() -> dict:
  """The search settings the flags give (max_extra_len None: the config's default)."""
  return search_fields(FLAGS, num_hypotheses=max(FLAGS.nbest, 1))


def _check_flags() -> None:
  """UsageError (or a ValueError naming a search field, printed as its flag) for flags that
  cannot go together or outputs that cannot be written, before any file is read."""
  fields = _search_fields()
  if FLAGS.beam_size is None:  # the workdir's beam, known once it is read: checked then
    fields.pop("num_hypotheses")
  SearchSettings(**fields)
  if FLAGS.score_reference and not (FLAGS.reference or FLAGS.split):
    raise UsageError("--score_reference scores given translations: give --reference or --split")
  for path, flag in (
    (FLAGS.output, "--output"),
    (FLAGS.json, "--json"),
    (FLAGS.plot_attention, "--plot_attention"),
  ):
    check_writable(path, flag)


def _texts() -> tuple[list[str] | None, list[str] | None]:
  """(sources, references) from --input/--reference; (None, None) for --split, whose text comes
  with the workdir's config, and for a stream (`_streamed`), checked through but not kept. Read
  before any model is loaded: a bad input fails first."""
  if FLAGS.split and FLAGS.input is not None:
    raise UsageError("give --split or --input, not both")
  if FLAGS.split and FLAGS.reference:
    raise UsageError("--split scores against the split's own references; drop --reference")
  if FLAGS.split:
    return None, None
  if _streamed():
    check_lines(FLAGS.input)
    return None, None
  return read_aligned(FLAGS.input, FLAGS.reference)


def _prefixes(sources: list[str] | None) -> list[str] | None:
  """The --target_prefix lines, checked against the input's line count where it is known before
  decoding (a file or the whole input; a split's once loaded, stdin's as it is read)."""
  if FLAGS.target_prefix is None:
    return None
  if FLAGS.score_reference:
    raise UsageError("--target_prefix: --score_reference scores whole given translations")
  prefixes = read_lines(FLAGS.target_prefix, "--target_prefix")
  count = len(sources) if sources is not None else check_lines(FLAGS.input)
  if not FLAGS.split and count >= 0:
    _check_prefix_count(prefixes, count)
  return prefixes


def _check_prefix_count(prefixes: list[str], count: int) -> None:
  if len(prefixes) != count:
    raise UsageError(
      f"--target_prefix={FLAGS.target_prefix} has {len(prefixes)} lines, the input has {count}"
    )


def _streamed() -> bool:
  """Whether the input is translated as it is read, chunk by chunk (bounded memory, outputs
  written as they are ready): unless references, a split or an attention plot need it whole."""
  return not (FLAGS.split or FLAGS.reference or FLAGS.plot_attention or FLAGS.score_reference)


def _interactive() -> bool:
  """Input typed at a terminal: each line is translated as soon as it is entered."""
  return FLAGS.input in (None, "-") and sys.stdin.isatty()


def _chunks(sources: list[str] | None):
  """(number of the first line, lines) to translate in turn: all of `sources` at once, else the
  stream's lines: one at a time from a terminal, --stream_lines at a time from a file or pipe."""
  if sources is not None:
    yield 1, sources
    return
  size = 1 if _interactive() else FLAGS.stream_lines
  chunk, first = [], 1
  for line in iter_lines(FLAGS.input):
    chunk.append(line)
    if len(chunk) == size:
      yield first, chunk
      first, chunk = first + size, []
  if chunk:
    yield first, chunk


@contextlib.contextmanager
def _output(path: str):
  """A text stream for the translations: stdout ('-') or the file `path`."""
  if path == "-":
    yield sys.stdout
    return
  try:
    with open(path, "w", encoding="utf-8") as out:
      yield out
  except OSError as e:
    raise UsageError(f"--output={path}: cannot write: {e.strerror or e}") from None


def _nbest_lines(result, offset: int = 0) -> list[str]:
  """'index ||| hypothesis ||| score' for each hypothesis of each sentence (index 0-based, as
  fairseq and Moses write them, counted from `offset`; an empty sentence has none)."""
  return [
    f"{offset + i} ||| {text} ||| {score:.6f}"
    for i, (texts, scores) in enumerate(zip(result.hypotheses, result.scores))
    for text, score in zip(texts, scores)
  ]


def _scored_line(pair) -> str:
  """'log-probability ||| per-token log-probabilities' of one scored pair."""
  return f"{pair.log_prob:.6f} ||| " + " ".join(f"{x:.6f}" for x in pair.token_log_probs)


def _load(phases: Phases) -> Translator:
  with phases.measure("restore"):
    return Translator.load(
      FLAGS.workdir,
      FLAGS.checkpoint,
      dtype=FLAGS.dtype,
      compilation_cache=True if FLAGS.compilation_cache is None else FLAGS.compilation_cache,
      read_ahead=True,
    )


def _split_texts(translator: Translator, prefixes) -> tuple[list[str], list[str]]:
  """(sources, references) of --split, from the workdir's dataset."""
  from data.sources import load_split  # a dataset's readers: not imported to translate a file

  try:
    pairs, _ = load_split(translator.config.data, FLAGS.split)
  except (ValueError, FileNotFoundError) as e:
    raise UsageError(f"--split={FLAGS.split}: {e}") from None
  sources, references = [s for s, _ in pairs], [t for _, t in pairs]
  if prefixes is not None:
    _check_prefix_count(prefixes, len(sources))
  return sources, references


def _score_references(translator: Translator, sources, references, phases: Phases) -> None:
  """--score_reference: each given pair's log-probabilities, written in input order."""
  with phases.measure("score"):
    pairs = translator.score_pairs(sources, references)
  write_lines(FLAGS.output, [_scored_line(pair) for pair in pairs])
  logging.info("Scored %d sentence pairs", len(pairs))
  logging.vlog(1, "Time by phase: %s", phases.summary())


def _check_plot(translator: Translator, sources) -> None:
  """--plot_attention's sentence exists and the model has cross-attention weights to plot."""
  plotted = FLAGS.plot_sentence
  if FLAGS.plot_attention and (plotted >= len(sources) or not sources[plotted].strip()):
    raise UsageError(
      f"--plot_sentence={plotted}: no such non-empty sentence (there are {len(sources)} input "
      f"lines)"
    )
  if FLAGS.plot_attention and not hasattr(translator.model, "decode"):
    raise UsageError(
      f"--plot_attention: model.type={translator.config.model.type!r} has no encoder-decoder "
      f"attention weights to plot"
    )


def _what(sources) -> str:
  """What is translated, for the log."""
  if sources is not None:
    empty = sum(not s.strip() for s in sources)
    return f"{len(sources) - empty} sentences ({empty} empty)"
  return f"{FLAGS.input} as it is read" if FLAGS.input not in (None, "-") else "stdin as it comes"


def _translate_all(translator, settings, sources, prefixes, keep_texts: bool, phases: Phases):
  """Translates the input chunk by chunk (`_chunks`), writing each chunk's lines as it is
  ready; returns (the last chunk's Translations, None without input; the texts if `keep_texts`;
  sentences, tokens, seconds)."""
  result, texts, sentences, tokens, seconds, lines = None, [], 0, 0, 0.0, 0
  with _output(FLAGS.output) as out:
    for first, chunk in _chunks(sources):
      lines += len(chunk)
      chunk_prefixes = None
      if prefixes is not None:
        chunk_prefixes = prefixes[first - 1 : lines]
        if len(prefixes) < lines:  # stdin: known as it is read
          _check_prefix_count(prefixes, lines)
      with phases.measure("translate"):
        result = translator.run(
          chunk,
          settings,
          seed=FLAGS.seed,
          tokens_per_batch=FLAGS.tokens_per_batch,
          progress=not _interactive(),
          return_scores=FLAGS.nbest > 0,
          first_line=first,
          batching=FLAGS.batching,
          pool_size=FLAGS.pool_size,
          target_prefixes=chunk_prefixes,
          parallel_batches=FLAGS.parallel_batches,
        )
      written = _nbest_lines(result, first - 1) if FLAGS.nbest else result.texts
      out.write("".join(f"{line}\n" for line in written))
      out.flush()
      sentences, tokens = sentences + result.sentences, tokens + result.tokens
      seconds += result.seconds
      if keep_texts:
        texts += result.texts
    if prefixes is not None:
      _check_prefix_count(prefixes, lines)  # stdin: known once read
  return result, texts, sentences, tokens, seconds


def _write_json(scores: dict, settings, translator: Translator, sentences, tokens, seconds):
  """--json: the scores, the speed and what was decoded with what."""
  summary = dict(
    scores,
    sentences=sentences,
    sent_per_s=sentences / seconds,
    tokens_per_s=tokens / seconds,
    beam_size=settings.beam_size,
    alpha=settings.alpha,
    length_penalty=settings.length_penalty,
    stopping=settings.stopping_rule,
    checkpoint_step=int(translator.step),
    checkpoint=FLAGS.checkpoint,
    checkpoint_steps=[int(s) for s in translator.restored.steps],
  )
  try:
    pathlib.Path(FLAGS.json).write_text(json.dumps(summary, indent=2) + "\n")
  except OSError as e:
    raise UsageError(f"--json={FLAGS.json}: cannot write: {e.strerror or e}") from None


def _plot(translator: Translator, result) -> None:
  """--plot_attention: the last layer's cross-attention of --plot_sentence, as a PNG."""
  plotted = FLAGS.plot_sentence
  weights = translator.attention(result, plotted)
  target = list(result.output_ids[plotted]) + [EOS_ID]
  from inference.attention_plot import plot_attention, token_labels  # matplotlib: only here

  plot_attention(
    FLAGS.plot_attention,
    weights,
    token_labels(translator.vocab, result.source_ids[plotted]),
    token_labels(translator.vocab, target),
    f"sentence {plotted} (line {plotted + 1}): last layer cross-attention, step {translator.step}",
  )
  logging.info("Wrote the attention plot of sentence %d to %s", plotted, FLAGS.plot_attention)


def main(started: float) -> None:
  """decode.py: checks, loads, translates (or scores), writes. `started`: when the process
  started (its start-up is the first phase)."""
  _check_flags()
  sources, references = _texts()
  prefixes = _prefixes(sources)
  phases = Phases(started=started)
  translator = _load(phases)
  try:
    _run(translator, sources, references, prefixes, phases)
  finally:  # the programs read ahead: stopped, and this run's recorded for the next
    if translator.programs is not None:
      translator.programs.finish()


def _run(translator: Translator, sources, references, prefixes, phases: Phases) -> None:
  """`main` once the model is loaded: translates (or scores) and writes."""
  if FLAGS.split:
    sources, references = _split_texts(translator, prefixes)
  settings = translator.settings(**_search_fields())
  if FLAGS.score_reference:
    _score_references(translator, sources, references, phases)
    return
  _check_plot(translator, sources)
  logging.info("Translating %s with %s", _what(sources), translator.describe(settings))
  result, texts, sentences, tokens, seconds = _translate_all(
    translator, settings, sources, prefixes, references is not None, phases
  )
  seconds = max(seconds, 1e-9)
  logging.info(
    "Translated %d sentences, %d tokens in %.2f s (compilation included): %.1f sentences/s, "
    "%.1f tokens/s",
    sentences,
    tokens,
    seconds,
    sentences / seconds,
    tokens / seconds,
  )
  scores = {"bleu": None, "bleu_lowercase": None, "chrf": None}
  if references is not None:
    with phases.measure("score"):
      scored = translator.metrics(texts, references)
    scores = scored.as_dict()
    scored.print_beside(FLAGS.output)
  logging.vlog(1, "Time by phase: %s", phases.summary())
  if FLAGS.json:
    _write_json(scores, settings, translator, sentences, tokens, seconds)
  if FLAGS.plot_attention:
    _plot(translator, result)
