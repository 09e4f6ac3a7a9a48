"""Scores of translations against references, with sacreBLEU: corpus BLEU cased (the standard)
and lowercased (as published Multi30k figures are), and chrF, each with its signature.

    scores = score(hypotheses, references)
    scores.bleu, scores.bleu_lowercase, scores.chrf, scores.lines
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

from core.errors import UsageError


@dataclasses.dataclass(frozen=True)
class Scores:
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


def score(hypotheses: Sequence[str], references: Sequence[str]) -> Scores:
  """Corpus scores of `hypotheses` against one reference each (same length, same order)."""
  if len(hypotheses) != len(references):
    raise UsageError(
      f"score: {len(hypotheses)} translations but {len(references)} references; they must "
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
  return Scores(lines=tuple(lines), **values)
