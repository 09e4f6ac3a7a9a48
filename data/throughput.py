"""How fast the input pipeline produces training batches.

    python -m data.throughput --name files --dir ../shared/data/multi30k --workdir /tmp/m30k

builds the pipeline (training the vocabulary and filling the token cache on the first run), then
prints batches/s and non-padding tokens/s of the training iterator.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator

import ml_collections
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


def main(argv: list[str] | None = None) -> None:
  from data import pipeline

  defaults = pipeline.default_data_config()
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--workdir", required=True, help="holds the vocabulary and token cache")
  parser.add_argument("--seconds", type=float, default=10.0)
  parser.add_argument("--batch_multiple", type=int, default=1)
  for key, value in defaults.items():
    kind = (lambda s: s.lower() in ("1", "true", "yes")) if isinstance(value, bool) else type(value)
    parser.add_argument(f"--{key}", type=kind, default=value, help=f"config.data.{key}")
  args = parser.parse_args(argv)
  data = ml_collections.ConfigDict({k: getattr(args, k) for k in defaults})
  config = ml_collections.ConfigDict({"seed": 0, "data": data})

  start = time.perf_counter()
  pipe = pipeline.build(config, args.workdir, batch_multiple=args.batch_multiple)
  print(
    f"build: {time.perf_counter() - start:.1f} s; shapes {pipe.batch_shapes}; "
    f"stats {pipe.stats[data.train_split]}"
  )
  result = measure_throughput(pipe.train_iter(), args.seconds)
  print(
    f"{result['batches']} batches: {result['batches_per_s']:.1f} batches/s, "
    f"{result['tokens_per_s'] / 1e6:.2f} M tokens/s (source+target, non-pad), "
    f"{result['target_tokens_per_s'] / 1e6:.2f} M target tokens/s"
  )


if __name__ == "__main__":
  main()
