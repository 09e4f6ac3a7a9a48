"""analysis/bleu_by_length.py: bucketing, per-bucket scores equal sacreBLEU on the subset; its
command line (cli/bleu_by_length.py)."""

import json

import pytest
from sacrebleu.metrics import BLEU

from analysis import bleu_by_length as bbl
from cli.files import read_lines
from core.errors import UsageError
from tests.helpers import run_in_process, run_py


def test_bucket_labels_and_membership():
  assert bbl.bucket_labels([10, 20]) == ["<=10", "11-20", ">20"]
  assert [bbl.bucket_of(n, [10, 20]) for n in (1, 10, 11, 20, 21, 99)] == [0, 0, 1, 1, 2, 2]


def test_scores_equal_sacrebleu_on_each_subset():
  sources = ["a b", "a b c d e", "a", "a b c d e f g"]
  refs = ["the cat sat", "a dog ran in the park", "hello", "one two three four five six"]
  hyps = ["the cat sat", "a dog ran in a park", "hi", "one two three four five"]
  out = bbl.bleu_by_length(sources, refs, {"sys": hyps}, [2, 5])
  assert [b["sentences"] for b in out["buckets"]] == [2, 1, 1]
  first = BLEU().corpus_score([hyps[0], hyps[2]], [[refs[0], refs[2]]]).score
  assert out["buckets"][0]["bleu"]["sys"] == pytest.approx(first)
  assert out["all"]["bleu"]["sys"] == pytest.approx(BLEU().corpus_score(hyps, [refs]).score)
  lower = bbl.bleu_by_length(
    sources, refs, {"sys": [h.upper() for h in hyps]}, [2, 5], lowercase=True
  )
  assert lower["all"]["bleu"]["sys"] == pytest.approx(out["all"]["bleu"]["sys"])
  empty = bbl.bleu_by_length(sources, refs, {"sys": hyps}, [10, 20])
  assert empty["buckets"][1] == {"bucket": "11-20", "sentences": 0, "bleu": {"sys": None}}


def test_mismatched_lengths_name_the_system():
  with pytest.raises(UsageError, match=r"systems\['b'\]: 1 lines, but sources has 2"):
    bbl.bleu_by_length(["x", "y"], ["x", "y"], {"a": ["x", "y"], "b": ["x"]}, [5])


def test_truncated_gz_names_the_file(tmp_path):
  import gzip

  cut = tmp_path / "cut.gz"
  cut.write_bytes(gzip.compress(b"a line\n" * 1000)[:-20])
  with pytest.raises(UsageError, match="cut.gz: cannot read"):
    read_lines(str(cut))


def test_cli_writes_table_json_and_plot(tmp_path):
  src, ref, hyp = tmp_path / "src", tmp_path / "ref", tmp_path / "hyp"
  src.write_text("a b\na b c d e f g h i j k l\n")
  ref.write_text("the cat sat on the mat\na dog ran in the big park\n")
  hyp.write_text("the cat sat on a mat\na dog ran in the big park\n")
  out_json, png = tmp_path / "o.json", tmp_path / "o.png"
  proc = run_py(
    "-m",
    "cli.bleu_by_length",
    f"--source={src}",
    f"--reference={ref}",
    f"--hyp=m={hyp}",
    "--edges=10",
    f"--json={out_json}",
    f"--plot={png}",
    timeout=120,
  )
  assert proc.returncode == 0, proc.stderr
  assert "<=10" in proc.stdout and ">10" in proc.stdout
  assert json.loads(out_json.read_text())["buckets"][1]["bleu"]["m"] == pytest.approx(100.0)
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  bad = run_in_process(
    "cli.bleu_by_length", f"--source={src}", f"--reference={ref}", "--hyp=nofile"
  )
  assert bad.returncode == 2 and "--hyp=nofile: expected NAME=FILE" in bad.stderr
