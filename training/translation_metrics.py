"""Metrics of translations against references, with sacreBLEU, the one place they are computed:
corpus BLEU cased (the standard) and lowercased (as published Multi30k figures are), and chrF,
each with its signature (training's evaluation, the translator and analysis/bleu_by_length.py
all score here).

    metrics = corpus_metrics(hypotheses, references)
    metrics.bleu, metrics.bleu_lowercase, metrics.chrf, metrics.lines
    score = corpus_bleu(hypotheses, references)          # cased BLEU alone
    metric = bleu(lowercase=True)                        # sacreBLEU's metric: its signature too
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


def bleu(lowercase: bool = False):
  """sacreBLEU's corpus BLEU with its default tokenization, cased or `lowercase`d
  (`.corpus_score(hypotheses, [references]).score`, `.get_signature()`)."""
  from sacrebleu.metrics import BLEU  # here: decoding without references needs none

  return BLEU(lowercase=lowercase)


def corpus_bleu(hypotheses: Sequence[str], references: Sequence[str]) -> float:
  """Cased corpus BLEU of `hypotheses` against one reference each (same order)."""
  return bleu().corpus_score(list(hypotheses), [list(references)]).score


def corpus_metrics(hypotheses: Sequence[str], references: Sequence[str]) -> Metrics:
  """Corpus scores of `hypotheses` against one reference each (same length, same order)."""
  if len(hypotheses) != len(references):
    raise UsageError(
      f"corpus_metrics: {len(hypotheses)} translations but {len(references)} references; they must "
      f"match line for line"
    )
  from sacrebleu.metrics import CHRF

  values, lines = {}, []
  for key, metric in (("bleu", bleu()), ("bleu_lowercase", bleu(lowercase=True)), ("chrf", CHRF())):
    result = metric.corpus_score(list(hypotheses), [list(references)])
    values[key] = result.score
    lines.append(result.format(signature=str(metric.get_signature())))
  return Metrics(lines=tuple(lines), **values)
