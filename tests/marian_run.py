"""Runs Marian itself (pymarian) on a tiny model, in its own process (Marian aborts the process on
an error): `python tests/marian_run.py <job.json>` prints a JSON list with one entry per run of
the job: a list of outputs, one per line (the translation as pieces joined by spaces; with
"word_scores", Marian's n-best line with each token's log-probability, `</s>` included).

job: {"model": npz, "vocab": yml, "lines": [...],
      "runs": [{"beam": k, "normalize": alpha, "word_scores": bool}, ...]}

Each sentence is its own batch (`--mini-batch 1`): Marian's length limit is 3 times the widest
source of a batch, so only then is it each sentence's own, as ours is.
"""

import json
import sys


def main(path: str) -> None:
  import pymarian

  job = json.loads(open(path, encoding="utf-8").read())
  results = []
  for run in job["runs"]:
    options = (
      f"-m {job['model']} -v {job['vocab']} {job['vocab']} --cpu-threads 1 --quiet"
      f" --beam-size {run['beam']} --normalize {run['normalize']} --word-penalty 0"
      f" --mini-batch 1 --maxi-batch 1 --max-length-factor 3 --max-length 1000"
      f" --workspace 128"
    )
    if run.get("word_scores"):
      options += " --n-best --word-scores"
    results.append(pymarian.Translator(options).translate(job["lines"]))
  print(json.dumps(results))


if __name__ == "__main__":
  main(sys.argv[1])
