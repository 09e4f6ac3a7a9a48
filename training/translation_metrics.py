"""Metrics of translations against references, with sacreBLEU: corpus BLEU cased (the standard)
and lowercased (as published Multi30k figures are), and chrF, each with its signature.

    metrics = corpus_metrics(hypotheses, references)
    metrics.bleu, metrics.bleu_lowercase, metrics.chrf, metrics.lines
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

from core.errors import UsageError


@dataclasses.dataclass(frozen=True)
class Metrics:
  bleu: float
  bleu_lowercase: float
  chrf: float
  lines: tuple[str, ...]  # sacreBLEU's printable result lines, with their signatures

  def as_dict(self) -> dict[str, float]:
    return {"bleu": self.bleu, "bleu_lowercase": self.bleu_lowercase, "chrf": self.chrf}

  def print_beside(self, output: str) -> None:
    """Prints the score lines on stdout, or on stderr when the translations (`output`, '-') go
    to stdout, as the command lines do."""
    for line in self.lines:
      print(line, file=sys.stderr if output == "-" else sys.stdout, flush=True)


def corpus_metrics(hypotheses: Sequence[str], references: Sequence[str]) -> Metrics:
  """Corpus scores of `hypotheses` against one reference each (same length, same order)."""
  if len(hypotheses) != len(references):
    raise UsageError(
      f"corpus_metrics: {len(hypotheses)} translations but {len(references)} references; they must "
      f"match line for line"
    )
  from sacrebleu.metrics import BLEU, CHRF  # here: decoding without references needs none

  values, lines = {}, []
  for key, metric in (
    ("bleu", BLEU()),
    ("bleu_lowercase", BLEU(lowercase=True)),
    ("chrf", CHRF()),
  ):
    result = metric.corpus_score(list(hypotheses), [list(references)])
    values[key] = result.score
    lines.append(result.format(signature=str(metric.get_signature())))
  return Metrics(lines=tuple(lines), **values)
