"""decode.py: a tiny model trained for a few steps by train.py (once per session: conftest's
`decode_workdir`), then decode.py run as a user would: in processes of its own where the process
matters (stdin to stdout, what is logged, the compilation cache across processes), in this process
(tests/helpers.py run_in_process: the same `__main__` and cli runner) for options, errors and
outputs."""

import json
import os
import re
import subprocess
import sys

import pytest

from core.cpu import native_dtype
from tests.helpers import REPO, one_device_env, run_in_process, run_py

pytestmark = pytest.mark.slow  # real command-line processes or trained workdirs

EXTRA = 3  # --max_extra_len of the runs here (conftest's decode_workdir: model.max_len 8)


def _checked(proc, check):
  if check and proc.returncode != 0:
    raise AssertionError(f"decode.py exited {proc.returncode}:\n{proc.stderr[-3000:]}")
  return proc


def decode(workdir, *flags, stdin="", check=True):
  """decode.py in this process; its stdout and stderr as text."""
  return _checked(run_in_process("decode.py", f"--workdir={workdir}", *flags, stdin=stdin), check)


def decode_py(workdir, *flags, stdin="", check=True):
  """decode.py in a process of its own, as a user runs it; its stdout and stderr as text."""
  return _checked(run_py("decode.py", f"--workdir={workdir}", *flags, stdin=stdin), check)


@pytest.fixture
def workdir(decode_workdir):
  assert sorted(p.name for p in (decode_workdir / "checkpoints").iterdir()) == ["2", "4"]
  return decode_workdir


SHORT = ["w1 w2 w3", "w5 w6 w7 w8 w9", "w3 w4", "w10 w11 w12 w13 w14 w15 w16"]
LONG = " ".join(f"w{i}" for i in range(12))  # > model.max_len=8 tokens
LINES = [SHORT[0], "", SHORT[1], LONG, SHORT[2], "   ", SHORT[3]]


@pytest.fixture(scope="module")
def piped(decode_workdir):
  """decode.py in a process of its own, LINES piped to its stdin, at `--verbosity=1` (what it
  logs is checked by test_default_verbosity_shows_no_library_chatter, what it writes by
  test_stdin_to_stdout_in_input_order)."""
  return decode_py(
    decode_workdir,
    "--beam_size=1",
    f"--max_extra_len={EXTRA}",
    "--verbosity=1",
    stdin="".join(f"{line}\n" for line in LINES),
  )


def test_stdin_to_stdout_in_input_order(workdir, piped):
  from inference.generator import Generator
  from inference.restore import load_for_inference
  from model.build import build_model
  from model.search_settings import SearchSettings
  from model.special_tokens import EOS_ID

  short, long, lines, proc = SHORT, LONG, LINES, piped
  out = proc.stdout.split("\n")
  assert out[-1] == "" and len(out) == len(lines) + 1, out
  assert out[1] == "" and out[5] == "", "empty (or blank) lines give empty lines"
  assert len({out[i] for i in (0, 2, 4, 6)}) > 1, out  # distinct lines: the order is checkable
  stderr = proc.stderr
  assert "truncated" in stderr and "line 4" in stderr, stderr[-2000:]
  assert "sentences/s" in stderr and "tokens/s" in stderr
  # Read and translated two lines at a time (a stream's chunks), through a pool of rows
  # (continuous batching): the same output, the same line numbers in the warning.
  chunked = decode(
    workdir,
    "--beam_size=1",
    f"--max_extra_len={EXTRA}",
    "--stream_lines=2",
    "--batching=continuous",
    stdin="".join(f"{line}\n" for line in lines),
  )
  assert chunked.stdout == proc.stdout
  assert "truncated to it: line 4" in chunked.stderr, chunked.stderr[-2000:]

  # Each short sentence translated alone, in this process, gives the same line.
  # (One generator: its calls, each of one sentence, compile the search once.)
  restored = load_for_inference(workdir)
  search = Generator(build_model(restored.config.model))
  settings = SearchSettings(beam_size=1, max_extra_len=EXTRA)
  vocab = restored.vocab
  for i, text in zip((0, 2, 4, 6), short):
    alone = search.translate_all(restored.params, [vocab.encode(text) + [EOS_ID]], settings)[0]
    assert out[i] == vocab.decode(alone.tolist()), (i, text)
  # The truncated line is translated from its first 7 words (+ EOS).
  cut = search.translate_all(restored.params, [vocab.encode(long)[:7] + [EOS_ID]], settings)[0]
  assert out[3] == vocab.decode(cut.tolist())


def test_split_scores_json_and_attention_plot(workdir, tmp_path):
  summary, png, hyps = tmp_path / "s.json", tmp_path / "a.png", tmp_path / "hyp.txt"
  proc = decode(
    workdir,
    "--split=test",
    "--beam_size=2",
    "--checkpoint=2",
    f"--json={summary}",
    f"--output={hyps}",
    f"--plot_attention={png}",
    "--plot_sentence=1",
  )
  stdout = proc.stdout
  assert "BLEU|nrefs:1|" in stdout and "chrF2|" in stdout, stdout
  result = json.loads(summary.read_text())
  assert "BLEU|nrefs:1|case:lc|" in stdout, stdout
  assert set(result) == {
    "bleu",
    "bleu_lowercase",
    "chrf",
    "sentences",
    "sent_per_s",
    "tokens_per_s",
    "beam_size",
    "alpha",
    "length_penalty",
    "stopping",
    "checkpoint_step",
    "checkpoint",
    "checkpoint_steps",
  }
  assert result["checkpoint"] == "2" and result["checkpoint_steps"] == [2]
  assert isinstance(result["bleu"], float) and 0 <= result["bleu"] <= 100
  # Lowercasing can only merge n-grams, so matches (and BLEU) never go down.
  assert result["bleu_lowercase"] >= result["bleu"] - 1e-9
  assert isinstance(result["chrf"], float)
  assert result["sentences"] == 16 and result["checkpoint_step"] == 2
  assert result["beam_size"] == 2 and result["alpha"] == 0.6
  assert result["sent_per_s"] > 0
  assert len(hyps.read_text().split("\n")) == 17
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_invalid_utf8_names_the_line(workdir):
  proc = decode(workdir, stdin=b"w1 w2\nw3 \xff w4\n", check=False)
  assert proc.returncode == 2
  err = proc.stderr.strip().splitlines()
  assert err[-1].startswith("decode.py: error:") and "line 2" in err[-1] and "UTF-8" in err[-1]
  assert "Traceback" not in proc.stderr


def test_unknown_step_lists_available_steps(workdir):
  proc = decode(workdir, "--checkpoint=999", stdin="w1\n", check=False)
  assert proc.returncode == 2
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("decode.py: error:") and "999" in last and "2, 4" in last, last
  assert "Traceback" not in proc.stderr


def test_empty_workdir_lists_its_contents(tmp_path):
  (tmp_path / "notes.txt").write_text("nothing here")
  proc = decode(tmp_path, stdin="w1\n", check=False)
  assert proc.returncode == 2
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("decode.py: error:") and "notes.txt" in last, last
  assert "Traceback" not in proc.stderr


def test_top_k_above_the_vocabulary_is_a_clear_error(workdir):
  proc = decode(workdir, "--temperature=1", "--top_k=100000", stdin="w1\n", check=False)
  assert proc.returncode == 2
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("decode.py: error: --top_k=100000: larger than the model's vocabulary"), (
    last
  )
  assert "Traceback" not in proc.stderr


def test_gzip_input_and_top_k_without_temperature(workdir, tmp_path):
  import gzip

  text = b"w1 w2 w3\nw5 w6\n"
  plain, packed = tmp_path / "in.txt", tmp_path / "in.txt.gz"
  plain.write_bytes(text)
  packed.write_bytes(gzip.compress(text))
  from_plain = decode(workdir, f"--input={plain}", "--beam_size=1").stdout
  assert decode(workdir, f"--input={packed}", "--beam_size=1").stdout == from_plain
  assert len(from_plain.split("\n")) == 3
  proc = decode(workdir, "--top_k=5", stdin="w1\n", check=False)
  assert proc.returncode == 2
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("decode.py: error: --top_k=5 applies to sampling only"), last


def test_score_cased_lowercased_and_chrf():
  from sacrebleu.metrics import BLEU, CHRF

  from training.translation_metrics import corpus_metrics

  out = corpus_metrics(["The cat sat on the mat ."], ["the cat sat on the mat ."]).as_dict()

  assert out["bleu_lowercase"] == pytest.approx(100.0) and out["bleu"] < 100.0
  assert out["bleu"] == pytest.approx(
    BLEU().corpus_score(["The cat sat on the mat ."], [["the cat sat on the mat ."]]).score
  )
  assert out["chrf"] == pytest.approx(
    CHRF().corpus_score(["The cat sat on the mat ."], [["the cat sat on the mat ."]]).score
  )


def test_ensemble_of_checkpoints(workdir, tmp_path):
  """`--checkpoint=ensemble:<k>`: an ensemble of one checkpoint translates as that checkpoint
  does; two decode together and are named in the JSON; a bad count is a one-line error."""
  text = "w1 w2 w3\nw4 w5\n"
  latest = decode(workdir, "--beam_size=1", stdin=text).stdout
  assert decode(workdir, "--beam_size=1", "--checkpoint=ensemble:1", stdin=text).stdout == latest
  summary = tmp_path / "e.json"
  png = tmp_path / "a.png"
  proc = decode(
    workdir,
    "--split=test",
    "--beam_size=2",
    "--checkpoint=ensemble:2",
    f"--json={summary}",
    f"--output={tmp_path / 'hyp.txt'}",
    f"--plot_attention={png}",
  )  # the plot shows the newest member's attention
  assert "an ensemble of the checkpoints of steps 2, 4" in proc.stderr
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  result = json.loads(summary.read_text())
  assert result["checkpoint_steps"] == [2, 4] and result["checkpoint_step"] == 4
  assert result["sentences"] == 16 and 0 <= result["bleu"] <= 100
  for bad, message in (
    ("ensemble:3", "ensemble:3 needs 1 to 2 checkpoints"),
    ("ensemble:x", "expected ensemble:<k> with k an integer"),
  ):
    proc = decode(workdir, f"--checkpoint={bad}", stdin=text, check=False)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-500:]


def test_bad_numbers_and_output_paths_fail_before_any_decoding(workdir, tmp_path):
  """NaN options, an output folder that does not exist and a damaged gzip input: one line each,
  exit 2, before the model is loaded (nothing is decoded, and no output file is created)."""
  for flags, message in (
    (["--alpha=nan"], "decode.py: error: --alpha=nan: must be a finite number >= 0"),
    (["--temperature=nan"], "--temperature=nan: must be a finite number >= 0"),
    (["--beam_size=0"], "--beam_size=0: must be >= 1"),
    (["--top_k=3"], "--top_k=3 applies to sampling only"),
    (["--stopping=soon"], "--stopping=soon: value should be one of <exact|finished>"),
    ([f"--output={tmp_path}/missing/out.txt"], "the folder"),
    ([f"--json={tmp_path}/missing/s.json"], "--json="),
    ([f"--plot_attention={tmp_path}"], "is a folder"),
  ):
    proc = decode(workdir, *flags, stdin="w1 w2\n", check=False)
    err = proc.stderr
    assert proc.returncode == 2 and message in err.strip().splitlines()[-1], (flags, err[-800:])
    assert "Translating" not in err and "Traceback" not in err, err[-800:]
  damaged = tmp_path / "in.txt.gz"
  body = "".join(f"w{i % 31} w{(7 * i) % 29} w{(3 * i) % 23}\n" for i in range(400)).encode()
  packed = __import__("gzip").compress(body)
  damaged.write_bytes(packed[: len(packed) // 2])  # a body cut short: a partial download
  proc = decode(workdir, f"--input={damaged}", check=False)
  last = proc.stderr.strip().splitlines()[-1]
  assert proc.returncode == 2 and f"--input={damaged}: cannot read" in last, last
  assert not (tmp_path / "missing").exists()


def test_default_verbosity_shows_no_library_chatter(workdir, piped):
  """Orbax's INFO lines and missing-metadata warning, and JAX's TPU-backend probe, stay hidden
  from a user's decode.py at `--verbosity=1` (the `piped` process; at the default verbosity in
  test_lines_typed_at_a_terminal_are_translated_as_they_come), which adds a few lines of the
  project's own: what was read, each program fetched or compiled with its batch's shape, the time
  of each phase; `--verbosity=2` (here in this process) brings the libraries' lines back."""
  hidden = lambda path: any(part.startswith(".") for part in path.relative_to(REPO).parts)
  own = {path.name for path in REPO.rglob("*.py") if not hidden(path)}  # no virtualenv's
  detail = piped.stderr
  lines = [line for line in detail.splitlines() if line.strip()]
  where = [re.match(r"[IWE]\d{4} [\d:.]+ +\d+ ([\w.]+):\d+\] ", line) for line in lines]
  assert all(where) and {m.group(1) for m in where} <= own, detail[-2000:]
  assert len(lines) <= 8, detail[-2000:]
  assert re.search(r"Read \d+ parameter arrays of .*/checkpoints/4 \(.*no optimizer state", detail)
  assert re.search(
    r"Program for int32\[\d+,\d+\](, steps \d+-\d+)? (read back|compiled) in", detail
  )
  assert re.search(r"Searched [\d,]+ rows x steps where the sentences needed [\d,]+ \(", detail)
  # Each phase's seconds (inference/phases.py), at --verbosity=1 only.
  phases = re.search(
    r"Time by phase: start-up [\d.]+ s, restore [\d.]+ s, (.*)$", detail, re.MULTILINE
  )
  assert phases and "translate" in phases.group(1), detail[-2000:]
  assert "compile or load" in phases.group(1) and "trace + lower" in phases.group(1)
  loud = decode(workdir, "--beam_size=1", "--verbosity=2", stdin="w1 w2\n").stderr
  files = {m.group(1) for m in re.finditer(r"[IWE]\d{4} [\d:.]+ +\d+ ([\w.]+):\d+\] ", loud)}
  assert files - own, loud[-2000:]  # the libraries' own lines
  assert len(loud.splitlines()) > 2 * len(lines)


def test_a_second_run_compiles_nothing(workdir, tmp_path):
  """decode.py's persistent compilation cache (inference/compilation_cache.py): the second process
  on the same workdir and input reads its search back from the `programs` subfolder
  (inference/program_store.py; the first run recorded it to be read ahead) and compiles, traces
  and looks up nothing else (JAX_LOG_COMPILES names each compilation, each cache hit and each
  tracing: a beam search makes no random key), and writes the same translations, importing
  neither Flax nor the model's linen modules nor Orbax (model/build.py's DeferredModel);
  --compilation_cache=off writes nothing there."""
  cache = tmp_path / "cache"
  env = one_device_env(JAX_LOG_COMPILES="1", JAX_COMPILATION_CACHE_DIR=str(cache))
  for name in (
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES",
  ):
    env.pop(name, None)  # decode.py's own minimums: every program is cached
  args = [sys.executable, "decode.py", f"--workdir={workdir}", f"--max_extra_len={EXTRA}"]
  stdin = b"w1 w2 w3\nw4 w5\nw6 w7 w8 w9\n"

  def logged(*extra):
    proc = subprocess.run(
      [*args, *extra], cwd=REPO, input=stdin, capture_output=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    err = proc.stderr.decode()
    err_lines[:] = err.splitlines()
    searches.append(
      err.count("Finished tracing _kept_search") + err.count("Finished tracing _kept_piece")
    )
    return proc.stdout, err.count("Finished XLA compilation of"), err.count("cache hit for")

  searches, err_lines = [], []
  first, compiled, hits = logged()
  assert compiled > 0 and hits == 0 and any(cache.iterdir())
  assert searches == [1] and len(list((cache / "programs").glob("*.program"))) == 1
  (record,) = (cache / "programs").glob("*.recent")  # the programs asked for: the next run's
  assert record.read_text().split() == [p.name for p in (cache / "programs").glob("*.program")]
  env["PYTHONPROFILEIMPORTTIME"] = "1"  # each module imported, on stderr
  second, compiled_again, hits = logged()
  assert second == first and compiled_again == hits == 0 and searches == [1, 0]
  imported = {line.rsplit("|", 1)[-1].strip() for line in err_lines if "import time:" in line}
  assert "jax" in imported and not imported & {"flax", "model.transformer", "orbax.checkpoint"}
  del env["PYTHONPROFILEIMPORTTIME"]
  off = tmp_path / "off"
  env["JAX_COMPILATION_CACHE_DIR"] = str(off)
  assert logged("--compilation_cache=off")[0] == first and not off.exists()


def test_nbest_lists_and_scoring_given_translations(workdir, tmp_path):
  """--nbest=k: k 'index ||| hypothesis ||| score' lines per sentence, best first, the first the
  translation decode.py writes without it; --score_reference: one 'log-probability ||| token
  log-probabilities' line per pair, equal to Translator.score_pairs; the flags' bad values one
  line each, before any work."""
  from inference import Translator

  lines = ["w1 w2 w3", "", "w5 w6 w7 w8"]
  stdin = "".join(f"{line}\n" for line in lines)
  search = ("--beam_size=3", f"--max_extra_len={EXTRA}", "--alpha=0.6")
  best = decode(workdir, *search, stdin=stdin).stdout.splitlines()
  nbest = decode(workdir, *search, "--nbest=3", stdin=stdin).stdout.splitlines()
  rows = [line.split(" ||| ") for line in nbest]
  assert [int(r[0]) for r in rows] == [0, 0, 0, 2, 2, 2], nbest
  for index in (0, 2):
    texts = [r[1] for r in rows if int(r[0]) == index]
    scores = [float(r[2]) for r in rows if int(r[0]) == index]
    assert texts[0] == best[index] and scores == sorted(scores, reverse=True), rows
    assert len(set(texts)) == 3 and all(s < 0 for s in scores)
  references = tmp_path / "refs.txt"
  references.write_text("w1 w2\nw3\nw5 w6 w7\n")
  scored = decode(
    workdir, "--score_reference", f"--reference={references}", stdin=stdin
  ).stdout.splitlines()
  pairs = Translator.load(workdir).score_pairs(lines, references.read_text().splitlines())
  assert len(scored) == 3
  for line, pair in zip(scored, pairs):
    total, tokens = line.split(" ||| ")
    assert float(total) == pytest.approx(pair.log_prob, abs=1e-5)
    assert [float(x) for x in tokens.split()] == pytest.approx(pair.token_log_probs, abs=1e-5)
  for flags, message in (
    (["--nbest=5", "--beam_size=3"], "--nbest=5: at most beam_size=3 hypotheses"),
    (["--nbest=5"], "--nbest=5: at most beam_size=4 hypotheses"),  # the workdir's eval.beam_size
    (["--nbest=-1"], "flag --nbest=-1: must be >= 0"),
    (["--score_reference"], "--score_reference scores given translations: give --reference"),
  ):
    proc = decode(workdir, *flags, stdin=stdin, check=False)
    assert proc.returncode == 2 and message in proc.stderr.strip().splitlines()[-1], proc.stderr


def test_lines_typed_at_a_terminal_are_translated_as_they_come(workdir, piped):
  """stdin a terminal (a pseudo-terminal here): each line's translation is written as soon as the
  line is entered, before the input ends, and equals the translation of the same lines piped
  (`piped`, same search); at the default verbosity its log is decode.py's own lines only (no
  library chatter), among them which dtype `--dtype=auto` chose and why, and no phase times."""
  import os
  import pty
  import select

  lines = [SHORT[0], SHORT[1]]
  expected = piped.stdout.splitlines()
  expected = [expected[LINES.index(line)] for line in lines]
  leader, follower = pty.openpty()
  proc = subprocess.Popen(
    [
      sys.executable,
      "decode.py",
      f"--workdir={workdir}",
      "--beam_size=1",
      f"--max_extra_len={EXTRA}",
    ],
    cwd=REPO,
    stdin=follower,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,  # a few lines: read once it ends
    env=one_device_env(),
  )
  os.close(follower)
  try:
    for line, translation in zip(lines, expected):
      os.write(leader, f"{line}\n".encode())
      ready, _, _ = select.select([proc.stdout], [], [], 300)
      assert ready, f"no translation of {line!r} while the input stays open"
      assert proc.stdout.readline().decode().rstrip("\n") == translation
    os.write(leader, b"\x04")  # end of input (Ctrl-D)
    assert proc.wait(timeout=120) == 0
    quiet = proc.stderr.read().decode()
  finally:
    proc.kill()
    os.close(leader)
  lines = [line for line in quiet.splitlines() if line.strip()]
  assert lines and all(("decode.py:" in line) for line in lines), quiet[-2000:]
  dtype, why = native_dtype("cpu")  # --dtype=auto: the line says which and why
  assert f"dtype {dtype} ({why}) on 1 cpu device(s)" in quiet, quiet[-2000:]
  assert "Time by phase" not in quiet


def test_decode_py_runs_its_main_with_the_imports_frozen(monkeypatch):
  """decode.py collects no garbage while importing and freezes what the imports made before its
  main runs (a second run's start-up: docs/experiments.md), the collector on again; numpy's
  OpenBLAS gets one thread (decoding runs no numpy matrix product) unless the environment says."""
  import gc

  from cli import app

  seen = []
  monkeypatch.setattr(
    app, "run", lambda *a, **k: seen.append((gc.get_freeze_count(), gc.isenabled()))
  )
  for preset in (None, "3"):
    if preset is None:
      monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    else:
      monkeypatch.setenv("OPENBLAS_NUM_THREADS", preset)
    assert run_in_process("decode.py").returncode == 0
    assert os.environ["OPENBLAS_NUM_THREADS"] == (preset or "1")
  assert len(seen) == 2 and all(frozen > 0 and enabled for frozen, enabled in seen)
