"""BLEU by source-length bucket for one or more systems' translations of the same test set: where
a model's quality falls off as sentences get longer (the RNN context vector's known weakness).

    python -m data.fetch multi30k --splits=test_2016_flickr --to=m30k
    python -m analysis.bleu_by_length --source=m30k/test_2016_flickr.de.gz \
        --reference=m30k/test_2016_flickr.en.gz \
        --hyp=rnn=rnn.txt --hyp=rnn_attention=att.txt --hyp=transformer=tf.txt \
        --edges=10,20 --lowercase --plot=bleu_by_length.png --json=bleu_by_length.json

Sentences are bucketed by the number of whitespace-separated words of their source (edges 10,20:
<=10, 11-20, >20) and each bucket is scored with sacreBLEU's corpus BLEU on its sentences only.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence

from absl import flags
from matplotlib.figure import Figure

from cli import app
from cli.files import check_writable, read_lines
from core.errors import UsageError

FLAGS = flags.FLAGS  # read by `run`, the command line's main


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """This command line's flags, defined only when it runs (cli/app.py)."""
  define = dict(flag_values=flag_values)
  flags.DEFINE_string("source", None, "Source sentences, one per line (.gz allowed).", **define)
  flags.DEFINE_string("reference", None, "Reference translations, one per line.", **define)
  flags.DEFINE_multi_string(
    "hyp", [], "NAME=FILE: one system's translations, one per line.", **define
  )
  flags.DEFINE_list("edges", ["10", "20"], "Bucket upper edges in source words.", **define)
  flags.DEFINE_bool(
    "lowercase", False, "Lowercased BLEU (as published Multi30k figures are computed).", **define
  )
  flags.DEFINE_string("plot", None, "Write a PNG bar chart here.", **define)
  flags.DEFINE_string("json", None, "Write the table as JSON here.", **define)


def bucket_labels(edges: Sequence[int]) -> list[str]:
  """[10, 20] -> ['<=10', '11-20', '>20']."""
  labels, low = [], 1
  for edge in edges:
    labels.append(f"<={edge}" if low == 1 else f"{low}-{edge}")
    low = edge + 1
  return labels + [f">{edges[-1]}"]


def bucket_of(num_words: int, edges: Sequence[int]) -> int:
  """Index of the bucket holding a source of `num_words` words."""
  for i, edge in enumerate(edges):
    if num_words <= edge:
      return i
  return len(edges)


def bleu_by_length(
  sources: Sequence[str],
  references: Sequence[str],
  systems: dict[str, Sequence[str]],
  edges: Sequence[int],
  lowercase: bool = False,
) -> dict:
  """{'buckets': [{'bucket', 'sentences', 'bleu': {system: score}}], 'all': {...}, 'signature'}.
  A bucket without sentences gets no scores (None)."""
  from sacrebleu.metrics import BLEU

  if list(edges) != sorted(set(edges)) or not edges or edges[0] < 1:
    raise UsageError(f"--edges={','.join(map(str, edges))}: must be increasing positive integers")
  for name, hyps in systems.items():
    if len(hyps) != len(sources):
      raise UsageError(f"--hyp={name}: {len(hyps)} lines, but the source has {len(sources)}")
  if len(references) != len(sources):
    raise UsageError(f"--reference: {len(references)} lines, but the source has {len(sources)}")
  metric = BLEU(lowercase=lowercase)
  members: list[list[int]] = [[] for _ in range(len(edges) + 1)]
  for i, src in enumerate(sources):
    members[bucket_of(len(src.split()), edges)].append(i)

  def scores(ids):
    if not ids:
      return {name: None for name in systems}
    refs = [[references[i] for i in ids]]
    return {
      name: metric.corpus_score([hyps[i] for i in ids], refs).score
      for name, hyps in systems.items()
    }

  return {
    "buckets": [
      {"bucket": label, "sentences": len(ids), "bleu": scores(ids)}
      for label, ids in zip(bucket_labels(edges), members)
    ],
    "all": {"sentences": len(sources), "bleu": scores(list(range(len(sources))))},
    "signature": str(metric.get_signature()),
  }


def plot(result: dict, path: str, title: str) -> None:
  """Grouped bars: BLEU per bucket, one bar per system."""
  buckets = result["buckets"]
  systems = list(result["all"]["bleu"])
  width = 0.8 / max(len(systems), 1)
  fig = Figure(figsize=(7, 4))
  ax = fig.subplots()
  for j, name in enumerate(systems):
    xs = [i + (j - (len(systems) - 1) / 2) * width for i in range(len(buckets))]
    ax.bar(xs, [b["bleu"][name] or 0.0 for b in buckets], width, label=name)
  ax.set_xticks(range(len(buckets)))
  ax.set_xticklabels([f"{b['bucket']} words\n({b['sentences']} sent.)" for b in buckets])
  ax.set_xlabel("source length")
  ax.set_ylabel("BLEU")
  ax.set_title(title, fontsize=9)
  ax.grid(axis="y", alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def run() -> dict:
  if not FLAGS.source or not FLAGS.reference or not FLAGS.hyp:
    raise UsageError("--source, --reference and at least one --hyp=NAME=FILE are required")
  check_writable(FLAGS.plot, "--plot")
  check_writable(FLAGS.json, "--json")
  systems = {}
  for spec in FLAGS.hyp:
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
      raise UsageError(f"--hyp={spec}: expected NAME=FILE")
    systems[name] = read_lines(path, f"--hyp={name}")
  try:
    edges = [int(e) for e in FLAGS.edges]
  except ValueError:
    raise UsageError(f"--edges={','.join(FLAGS.edges)}: not integers") from None
  result = bleu_by_length(
    read_lines(FLAGS.source, "--source"),
    read_lines(FLAGS.reference, "--reference"),
    systems,
    edges,
    FLAGS.lowercase,
  )
  names = list(systems)
  print("  ".join(["bucket".ljust(8), "sentences".rjust(9)] + [n.rjust(12) for n in names]))
  for b in result["buckets"] + [dict(result["all"], bucket="all")]:
    cells = ["-" if b["bleu"][n] is None else f"{b['bleu'][n]:.2f}" for n in names]
    print(
      "  ".join([b["bucket"].ljust(8), str(b["sentences"]).rjust(9)] + [c.rjust(12) for c in cells])
    )
  print(result["signature"])
  if FLAGS.plot:
    plot(result, FLAGS.plot, f"BLEU by source length ({result['signature']})")
  if FLAGS.json:
    pathlib.Path(FLAGS.json).write_text(json.dumps(result, indent=2) + "\n")
  return result


if __name__ == "__main__":
  define_flags()
  app.run(run, prog="analysis.bleu_by_length")
