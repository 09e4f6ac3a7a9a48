"""Translates text with a trained model, and scores it against references when given.

    python decode.py --workdir=/tmp/tiny < source.txt > translations.txt
    python decode.py --workdir=/tmp/tiny --split=test --json=test.json
    python decode.py --workdir=runs/base --input=newstest2014.en --reference=newstest2014.de \
        --checkpoint=average:5 --beam_size=4 --alpha=0.6
    python decode.py --workdir=runs/base --split=test --checkpoint=ensemble:3   # 3 models at once

Everything (parameters, config, vocabulary) comes from the workdir. Translations are written one
per line in input order; an empty input line gives an empty output line. With references the
sacreBLEU score lines go to stdout, or to stderr when the translations do.
"""

from __future__ import annotations

import gzip
import json
import math
import pathlib
import sys
import time
import zlib

if __name__ == "__main__":  # first, before JAX starts its threads: see cli/host_memory.py
  from cli.host_memory import keep_freed_memory_on_cpu

  keep_freed_memory_on_cpu()

import jax  # noqa: E402
import matplotlib  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
from absl import flags, logging  # noqa: E402
from sacrebleu.metrics import BLEU, CHRF  # noqa: E402

from cli import app  # noqa: E402
from cli.errors import UsageError  # noqa: E402
from data.sources import load_split  # noqa: E402
from inference.restore import load_for_inference  # noqa: E402
from model import generate  # noqa: E402
from model.build import build_model  # noqa: E402
from model.special_tokens import EOS_ID  # noqa: E402

_WORKDIR = flags.DEFINE_string("workdir", None, "Training workdir: checkpoints, config, vocab.")
_INPUT = flags.DEFINE_string("input", None, "Source sentences, one per line; '-' or unset = stdin.")
_OUTPUT = flags.DEFINE_string("output", "-", "Where translations go; '-' = stdout.")
_REFERENCE = flags.DEFINE_string("reference", None, "Reference translations, one per line.")
_SPLIT = flags.DEFINE_string(
  "split",
  None,
  "Translate this split of the workdir's dataset "
  "(e.g. test) and score against its references; replaces --input.",
)
_BEAM = flags.DEFINE_integer("beam_size", 4, "Beam size; 1 = greedy search.", lower_bound=1)
_ALPHA = flags.DEFINE_float("alpha", 0.6, "Length penalty exponent of beam search.")
_EXTRA = flags.DEFINE_integer(
  "max_extra_len",
  None,
  "Output length limit = source length + this (default: config.eval.max_decode_extra).",
  lower_bound=0,
)
_CHECKPOINT = flags.DEFINE_string(
  "checkpoint",
  "latest",
  "'latest', a step number, 'average:<k>' (the mean of the "
  "last k checkpoints' parameters) or 'ensemble:<k>' (the last k "
  "checkpoints decoded together: the mean of their next-token "
  "probabilities, k times the decoding work).",
)
_JSON = flags.DEFINE_string("json", None, "Write scores and speed to this JSON file.")
_DTYPE = flags.DEFINE_enum(
  "dtype",
  None,
  ["float32", "bfloat16"],
  "Computation dtype (default: the training config's model.dtype).",
)
_TEMPERATURE = flags.DEFINE_float(
  "temperature", 0.0, "> 0: sample instead of searching.", lower_bound=0.0
)
_TOP_K = flags.DEFINE_integer(
  "top_k", 0, "Sample from the k most likely tokens (0 = all).", lower_bound=0
)
_SEED = flags.DEFINE_integer("seed", 0, "Random seed of sampling.")
_TOKENS = flags.DEFINE_integer(
  "tokens_per_batch", 4096, "Padded source tokens per batch.", lower_bound=1
)
_PLOT = flags.DEFINE_string(
  "plot_attention", None, "Write a PNG of the cross-attention weights of one sentence."
)
_PLOT_SENTENCE = flags.DEFINE_integer(
  "plot_sentence",
  0,
  "Which sentence to plot: 0-based index into the input lines (or the split).",
  lower_bound=0,
)
flags.mark_flag_as_required("workdir")


# ---------------------------------------------------------------------------------------------
# Text in and out.


def read_lines(path: str | None, what: str) -> list[str]:
  """Lines of a UTF-8 file, gzip-compressed or not ('-' or None = stdin), without their line
  terminators."""
  name = "stdin" if path in (None, "-") else f"{what}={path}"
  try:
    data = sys.stdin.buffer.read() if name == "stdin" else pathlib.Path(path).read_bytes()
    if data[:2] == b"\x1f\x8b":  # the gzip magic number
      data = gzip.decompress(data)
  except (OSError, EOFError, zlib.error) as e:
    raise UsageError(f"{name}: cannot read: {getattr(e, 'strerror', None) or e}") from None
  raw = data.split(b"\n")
  if raw[-1] == b"":  # the final newline ends the last line, it does not start a new one
    raw.pop()
  lines = []
  for number, line in enumerate(raw, start=1):
    try:
      lines.append(line.decode("utf-8").rstrip("\r"))
    except UnicodeDecodeError as e:
      raise UsageError(
        f"{name}, line {number}: invalid UTF-8 ({e.reason} at byte {e.start})"
      ) from None
  return lines


def write_lines(path: str, lines: list[str]) -> None:
  data = "".join(line + "\n" for line in lines).encode("utf-8")
  if path == "-":
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()
    return
  try:
    pathlib.Path(path).write_bytes(data)
  except OSError as e:
    raise UsageError(f"--output={path}: cannot write: {e.strerror or e}") from None


def _line_list(numbers: list[int], limit: int = 20) -> str:
  shown = ", ".join(map(str, numbers[:limit]))
  return shown + (f" and {len(numbers) - limit} more" if len(numbers) > limit else "")


def encode_sources(vocab, lines: list[str], max_len: int) -> list[list[int] | None]:
  """Token ids + EOS of each line (None for an empty line), cut to `max_len` with a warning."""
  sources, cut = [], []
  for number, line in enumerate(lines, start=1):
    text = line.strip()
    if not text:
      sources.append(None)
      continue
    ids = vocab.encode(text)
    if len(ids) + 1 > max_len:
      cut.append(number)
      ids = ids[: max_len - 1]
    sources.append(list(ids) + [EOS_ID])
  if cut:
    logging.warning(
      "%d input line(s) longer than model.max_len=%d tokens (EOS included) were truncated: line %s",
      len(cut),
      max_len,
      _line_list(cut),
    )
  return sources


def token_labels(vocab, ids) -> list[str]:
  """Readable labels of token ids: the vocabulary's pieces or words, else the ids."""
  return [vocab.piece(int(i)) or str(int(i)) for i in ids]


# ---------------------------------------------------------------------------------------------
# Scores and plots.


def score(hypotheses: list[str], references: list[str]) -> tuple[dict, list[str]]:
  """sacreBLEU corpus BLEU (cased, the standard; and lowercased, as published Multi30k figures
  are) and chrF: ({'bleu', 'bleu_lowercase', 'chrf'}, printable lines with signatures)."""
  values, lines = {}, []
  for key, metric in (("bleu", BLEU()), ("bleu_lowercase", BLEU(lowercase=True)), ("chrf", CHRF())):
    result = metric.corpus_score(hypotheses, [references])
    values[key] = result.score
    lines.append(result.format(signature=str(metric.get_signature())))
  return values, lines


def plot_attention(
  path: str, weights, src_labels: list[str], tgt_labels: list[str], title: str
) -> None:
  """PNG of the last layer's cross-attention: one panel per head, then their average.

  weights: [layers, heads, tgt_len, src_len].
  """
  last = weights[-1]
  panels = [(f"head {h}", w) for h, w in enumerate(last)] + [("average", last.mean(axis=0))]
  cols = min(3, len(panels))
  rows = math.ceil(len(panels) / cols)
  tgt_len, src_len = last.shape[1:]
  width = min(12.0, 1.5 + 0.3 * src_len)
  height = min(12.0, 1.5 + 0.3 * tgt_len)
  fig, axes = plt.subplots(
    rows, cols, figsize=(cols * width, rows * height), squeeze=False, layout="constrained"
  )
  for ax in axes.flat[len(panels) :]:
    ax.axis("off")
  for ax, (name, w) in zip(axes.flat, panels):
    image = ax.imshow(w, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
    ax.set_xticks(range(src_len), src_labels, rotation=90, fontsize=8)
    ax.set_yticks(range(tgt_len), tgt_labels, fontsize=8)
    ax.set_xlabel("source")
    ax.set_ylabel("target")
    ax.set_title(name)
  fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight")
  fig.suptitle(title)
  try:
    fig.savefig(path, dpi=100)
  except OSError as e:
    raise UsageError(f"--plot_attention={path}: cannot write: {e.strerror or e}") from None
  finally:
    plt.close(fig)


# ---------------------------------------------------------------------------------------------


def decode() -> None:
  if _SPLIT.value and _INPUT.value is not None:
    raise UsageError("give --split or --input, not both")
  if _SPLIT.value and _REFERENCE.value:
    raise UsageError("--split scores against the split's own references; drop --reference")

  # Read the text first: a bad input fails before any model is loaded.
  sources = references = None
  if not _SPLIT.value:
    sources = read_lines(_INPUT.value, "--input")
    if _REFERENCE.value:
      references = read_lines(_REFERENCE.value, "--reference")
      if len(references) != len(sources):
        raise UsageError(
          f"--reference={_REFERENCE.value} has {len(references)} lines, the "
          f"input has {len(sources)}"
        )

  restored = load_for_inference(_WORKDIR.value, _CHECKPOINT.value)
  config, vocab = restored.config, restored.vocab
  if _SPLIT.value:
    try:
      pairs, _ = load_split(config.data, _SPLIT.value)
    except (ValueError, FileNotFoundError) as e:
      raise UsageError(f"--split={_SPLIT.value}: {e}") from None
    sources, references = [s for s, _ in pairs], [t for _, t in pairs]

  model_cfg = config.model.copy_and_resolve_references()
  if _DTYPE.value:
    model_cfg.dtype = _DTYPE.value
  model = build_model(model_cfg)
  max_extra = _EXTRA.value if _EXTRA.value is not None else config.eval.max_decode_extra

  src_ids = encode_sources(vocab, sources, int(config.model.max_len))
  if _PLOT.value:
    n = _PLOT_SENTENCE.value
    if n >= len(src_ids) or src_ids[n] is None:
      raise UsageError(
        f"--plot_sentence={n}: no such non-empty sentence (there are {len(src_ids)} input lines)"
      )
    if not hasattr(model, "decode"):
      raise UsageError(
        f"--plot_attention: model.type={model_cfg.type!r} has no "
        f"encoder-decoder attention weights to plot"
      )

  if _TOP_K.value and not _TEMPERATURE.value > 0:
    raise UsageError(
      f"--top_k={_TOP_K.value} applies to sampling only: add --temperature "
      f"(e.g. --temperature=1) or drop --top_k"
    )
  if _TEMPERATURE.value > 0 and _TOP_K.value > int(model_cfg.vocab_size):
    raise UsageError(
      f"--top_k={_TOP_K.value}: larger than the model's vocabulary "
      f"({model_cfg.vocab_size} ids); use 0 for all of them"
    )
  present = [i for i, s in enumerate(src_ids) if s is not None]
  if _TEMPERATURE.value > 0:
    how = f"sampling at temperature {_TEMPERATURE.value:g} (top_k {_TOP_K.value})"
  elif _BEAM.value > 1:
    how = f"beam search (beam {_BEAM.value}, alpha {_ALPHA.value:g})"
  else:
    how = "greedy search"
  which = (
    f"an ensemble of the checkpoints of steps {', '.join(map(str, restored.steps))}"
    if restored.ensemble
    else f"checkpoint step {restored.step}"
  )
  logging.info(
    "Translating %d sentences (%d empty) with %s, %s, %s, dtype %s on %s",
    len(present),
    len(src_ids) - len(present),
    model_cfg.type,
    which,
    how,
    model_cfg.dtype,
    jax.devices()[0].platform,
  )
  params = jax.device_put(restored.params)
  start = time.perf_counter()
  outputs = generate.translate_all(
    model,
    params,
    [src_ids[i] for i in present],
    tokens_per_batch=_TOKENS.value,
    beam_size=_BEAM.value,
    alpha=_ALPHA.value,
    max_extra_len=max_extra,
    temperature=_TEMPERATURE.value,
    top_k=_TOP_K.value,
    rng=jax.random.key(_SEED.value),
    num_ids=vocab.vocab_size,
    ensemble=restored.ensemble,
  )
  seconds = max(time.perf_counter() - start, 1e-9)
  out_ids: list = [None] * len(src_ids)
  for i, ids in zip(present, outputs):
    out_ids[i] = ids
  hypotheses = ["" if ids is None else vocab.decode(ids.tolist()) for ids in out_ids]
  write_lines(_OUTPUT.value, hypotheses)

  tokens = sum(len(o) for o in outputs)
  logging.info(
    "Translated %d sentences, %d tokens in %.2f s (compilation included): %.1f "
    "sentences/s, %.1f tokens/s",
    len(present),
    tokens,
    seconds,
    len(present) / seconds,
    tokens / seconds,
  )

  scores = {"bleu": None, "bleu_lowercase": None, "chrf": None}
  if references is not None:
    scores, lines = score(hypotheses, references)
    stream = sys.stderr if _OUTPUT.value == "-" else sys.stdout
    for line in lines:
      print(line, file=stream, flush=True)

  if _JSON.value:
    summary = dict(
      scores,
      sentences=len(present),
      sent_per_s=len(present) / seconds,
      tokens_per_s=tokens / seconds,
      beam_size=_BEAM.value,
      alpha=_ALPHA.value,
      checkpoint_step=int(restored.step),
      checkpoint=_CHECKPOINT.value,
      checkpoint_steps=[int(s) for s in restored.steps],
    )
    try:
      pathlib.Path(_JSON.value).write_text(json.dumps(summary, indent=2) + "\n")
    except OSError as e:
      raise UsageError(f"--json={_JSON.value}: cannot write: {e.strerror or e}") from None

  if _PLOT.value:
    n = _PLOT_SENTENCE.value
    if restored.ensemble:  # the plot shows one model: the ensemble's newest member
      params = jax.tree_util.tree_map(lambda x: x[-1], params)
    weights = generate.attention_weights(model, params, src_ids[n], out_ids[n])
    tgt = list(out_ids[n]) + [generate.EOS_ID]
    plot_attention(
      _PLOT.value,
      weights,
      token_labels(vocab, src_ids[n]),
      token_labels(vocab, tgt),
      f"sentence {n} (line {n + 1}): last layer cross-attention, step {restored.step}",
    )
    logging.info("Wrote the attention plot of sentence %d to %s", n, _PLOT.value)


if __name__ == "__main__":
  matplotlib.use("Agg")
  app.run(decode, prog="decode.py")
