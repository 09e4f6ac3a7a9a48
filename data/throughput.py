"""How fast the input pipeline produces training batches: `measure_throughput` pulls batches for
a while and counts them and their tokens (the command line: cli/throughput.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np


def measure_throughput(
  batches: Iterator[dict[str, np.ndarray]], seconds: float = 5.0
) -> dict[str, float]:
  """Pulls batches for about `seconds`; returns `batches_per_s`, `target_tokens_per_s` and
  `tokens_per_s` (non-padding tokens, source and target together), and `batches`."""
  count = tokens = target_tokens = 0
  start = time.perf_counter()
  while (elapsed := time.perf_counter() - start) < seconds:
    batch = next(batches)
    count += 1
    target_tokens += int(np.count_nonzero(batch["targets_segmentation"]))
    tokens += int(np.count_nonzero(batch["inputs_segmentation"]))
  tokens += target_tokens
  return {
    "batches": count,
    "batches_per_s": count / elapsed,
    "tokens_per_s": tokens / elapsed,
    "target_tokens_per_s": target_tokens / elapsed,
  }
