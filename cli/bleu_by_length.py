"""The command line of BLEU by source-length bucket (analysis/bleu_by_length.py): one or more
systems' translations of the same test set, scored by the length of their sources.

    python -m cli.fetch multi30k --splits=test_2016_flickr --to=m30k
    python -m cli.bleu_by_length --source=m30k/test_2016_flickr.de.gz \
        --reference=m30k/test_2016_flickr.en.gz \
        --hyp=rnn=rnn.txt --hyp=rnn_attention=att.txt --hyp=transformer=tf.txt \
        --edges=10,20 --lowercase --plot=bleu_by_length.png --json=bleu_by_length.json

Sentences are bucketed by the number of whitespace-separated words of their source (edges 10,20:
<=10, 11-20, >20) and each bucket is scored with sacreBLEU's corpus BLEU on its sentences only.
"""

from __future__ import annotations

import json
import pathlib

from absl import flags

from analysis.bleu_by_length import bleu_by_length, plot
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
  app.run(run, prog="cli.bleu_by_length")
