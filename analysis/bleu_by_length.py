"""BLEU by source-length bucket for one or more systems' translations of the same test set: where
a model's quality falls off as sentences get longer (the RNN context vector's known weakness).

    result = bleu_by_length(sources, references, {"rnn": rnn, "transformer": tf}, [10, 20])
    plot(result, "bleu_by_length.png", "BLEU by source length")

(the command line: cli/bleu_by_length.py).

Sentences are bucketed by the number of whitespace-separated words of their source (edges 10,20:
<=10, 11-20, >20) and each bucket is scored with sacreBLEU's corpus BLEU on its sentences only
(training/translation_metrics.py `bleu`).
"""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.figure import Figure

from core.errors import ArgumentError, UsageError
from training.translation_metrics import bleu


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
  if list(edges) != sorted(set(edges)) or not edges or edges[0] < 1:
    raise ArgumentError("edges", ",".join(map(str, edges)), "must be increasing positive integers")
  for name, hyps in systems.items():
    if len(hyps) != len(sources):
      raise UsageError(f"systems[{name!r}]: {len(hyps)} lines, but sources has {len(sources)}")
  if len(references) != len(sources):
    raise UsageError(f"references: {len(references)} lines, but sources has {len(sources)}")
  metric = bleu(lowercase)
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
