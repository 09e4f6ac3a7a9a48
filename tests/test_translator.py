"""The translation API (inference/translator.py): the same translations as decode.py for every
model type, the README's example as written, empty and over-long sentences, bad options, and the
progress bar."""

import io
import logging
import re

import jax
import numpy as np
import pytest

from core.cpu import usable_cores
from core.errors import UsageError
from core.progress import Progress
from inference import Translator
from model.search_settings import SearchSettings
from tests.helpers import JAX_CACHE_OPTIONS, MODEL_TYPES, REPO, run_in_process

pytestmark = pytest.mark.slow  # real command-line processes or trained workdirs

SENTENCES = ["w1 w2 w3", "", "w5 w6 w7 w8 w9", "w3 w4", "w10 w11 w12 w13 w14 w15"]
# SENTENCES' and three more: the n-best and int8 tests search the same 7 sentences (their float32
# beam searches share one program).
MORE = [s for s in SENTENCES if s] + ["w2 w4 w6 w8", "w9 w7 w5", "w11 w1 w3 w12 w2"]


@pytest.fixture
def workdirs(model_type_workdirs):
  """{model.type: workdir}: a few steps of each model type on the synthetic task (conftest)."""
  return model_type_workdirs


_LOADED: dict = {}


def loaded(workdir, dtype: str = "auto") -> Translator:
  """`Translator.load(workdir, dtype=dtype, compilation_cache=True)`, loaded once per module for
  the tests that do not check loading itself: they share its compiled searches (the same settings
  compile once), and decode.py run in this process reads them back from the program store as a
  second run does (the session's cache folder, conftest's $JAX_COMPILATION_CACHE_DIR: decode.py's
  default, so JAX's options stay as they were)."""
  key = (str(workdir), dtype)
  if key not in _LOADED:
    _LOADED[key] = Translator.load(workdir, dtype=dtype, compilation_cache=True)
  return _LOADED[key]


@pytest.mark.parametrize("kind", MODEL_TYPES)
def test_the_api_and_decode_py_give_the_same_translations(workdirs, kind):
  """decode.py run in this process (tests/helpers.py run_in_process; tests/test_decode.py runs
  it as its own process too); it reads the API's compiled search back from the program store
  (`loaded`), so the two differ only in what is around the search."""
  translator = loaded(workdirs[kind])
  stdin = "".join(f"{s}\n" for s in SENTENCES)
  api = translator.translate(SENTENCES, beam_size=2, max_extra_len=4)
  cli = run_in_process(
    "decode.py", f"--workdir={workdirs[kind]}", "--beam_size=2", "--max_extra_len=4", stdin=stdin
  )
  assert cli.returncode == 0, cli.stderr[-3000:]
  assert cli.stdout.split("\n")[:-1] == api, kind
  assert api[1] == "" and len(api) == len(SENTENCES)
  assert any(api), api  # something was written


def test_the_readme_example_runs_as_written(workdirs, capsys):
  """The README's Python example, with its workdir pointed at a trained one."""
  readme = (REPO / "README.md").read_text()
  blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
  assert blocks, "the README has no Python example"
  example = blocks[0]
  workdirs_in_it = re.findall(r'Translator\.load\("([^"]+)"', example)
  assert workdirs_in_it, example
  code = example.replace(workdirs_in_it[0], str(workdirs["transformer"]))
  code = code.replace('checkpoint="average:5"', 'checkpoint="latest"')
  exec(compile(code, "README.md", "exec"), {})
  printed = capsys.readouterr().out
  assert printed.strip(), "the example prints its translations"


def test_long_sentences_are_cut_with_a_warning_and_options_are_checked(
  workdirs, caplog, monkeypatch
):
  """Every greedy search here (and test_continuous_batching_gives_the_same_translations') is of
  one-row batches under the default max_extra_len: one compiled program."""
  translator = loaded(workdirs["transformer"])
  long = " ".join(f"w{i % 30}" for i in range(40))  # > model.max_len=24 tokens
  batched = dict(tokens_per_batch=1, beam_size=1)  # one sentence a batch
  with caplog.at_level(logging.WARNING):
    result = translator.run(["w1 w2", long, "  "], **batched)
  assert result.truncated == [1] and result.sentences == 2 and result.texts[2] == ""
  assert "1 of 3 sentences are longer than model.max_len=24" in caplog.text
  assert "truncated to it: line 2" in caplog.text
  assert len(result.source_ids[1]) == 24 and result.source_ids[1][-1] == 1  # cut, EOS kept
  for options, message in (
    ({"beam_size": 0}, "beam_size=0: must be >= 1"),
    ({"alpha": float("nan")}, "alpha=nan: must be a finite number >= 0"),
    ({"temperature": float("inf")}, "temperature=inf: must be a finite number >= 0"),
    ({"top_k": 3}, "top_k=3 applies to sampling only"),
    ({"max_extra_len": -1}, "max_extra_len=-1: must be >= 0"),
    ({"temperature": 1.0, "top_k": 10**6}, "top_k=1000000: larger than the model's vocabulary"),
    ({"beam": 2}, "'beam'; the search settings are beam_size, alpha"),
    ({"parallel_batches": 0}, "parallel_batches=0: must be >= 1"),
  ):
    with pytest.raises(UsageError, match=re.escape(message)):
      translator.translate(["w1"], **options)
  # A SearchSettings value, or its fields as keywords: the same search.
  explicit = translator.settings(beam_size=1, max_extra_len=2)
  assert explicit == SearchSettings(beam_size=1, max_extra_len=2)
  settings = translator.settings(beam_size=1)
  default = translator.config.eval.max_decode_extra
  assert settings == SearchSettings(beam_size=1, max_extra_len=default)
  assert translator.translate(["w1 w2", long], settings, tokens_per_batch=1) == result.texts[:2]
  # One sentence a batch, two batches at a time: the same translations, in order.
  sentences = ["w1 w2", long, "w3", "w4 w5 w6"]
  assert translator.translate(sentences, parallel_batches=2, **batched) == translator.translate(
    sentences, parallel_batches=1, **batched
  )
  # By default on one CPU device, a thread more than the cores: each one's host work between
  # pieces would leave its core idle.
  seen = []
  real = translator.generator.translate_all
  with monkeypatch.context() as m:
    m.setattr(
      translator.generator, "translate_all", lambda *a, **k: seen.append(k) or real(*a, **k)
    )
    assert translator.translate(sentences, **batched) == translator.translate(
      sentences, parallel_batches=1, **batched
    )
  assert [k["parallel_batches"] for k in seen] == [usable_cores() + 1, 1]
  assert translator.settings().max_extra_len == translator.config.eval.max_decode_extra
  with pytest.raises(UsageError, match="expected a list of sentences"):
    translator.translate("w1 w2")
  scores = translator.metrics(["w1 w2 w3 w4 w5"], ["w1 w2 w3 w4 w5"])
  assert scores.bleu == pytest.approx(100.0) and len(scores.lines) == 3


def test_decoding_over_two_devices_equals_one(workdirs):
  """Batches split over two (simulated) devices translate as on one (the default on CPUs: the
  first device; the search of test_the_api_and_decode_py_give_the_same_translations)."""
  one = loaded(workdirs["transformer"])
  assert one.devices == jax.local_devices()[:1]
  two = Translator.load(workdirs["transformer"], devices=jax.local_devices()[:2])
  sentences = [s for s in SENTENCES if s]  # 4 rows: 2 on each device
  assert two.translate(sentences, beam_size=2, max_extra_len=4) == one.translate(
    sentences, beam_size=2, max_extra_len=4
  )


class _Terminal(io.StringIO):
  def isatty(self):
    return True


def test_the_progress_bar_shows_rate_and_eta_on_a_terminal_only():
  screen = _Terminal()
  bar = Progress(100, 0, unit="sentences", stream=screen)
  bar.update(40)
  bar.close()
  text = screen.getvalue()
  assert "40/100" in text and "sentences/s" in text and "ETA" in text and text.endswith("\n")
  pipe = io.StringIO()
  bar = Progress(100, 0, unit="sentences", stream=pipe)
  bar.update(40)
  bar.close()
  assert pipe.getvalue() == ""


def test_the_compilation_cache_when_asked(workdirs, tmp_path):
  """`Translator.load(..., compilation_cache=folder)` turns JAX's persistent compilation cache on
  in that folder and keeps the compiled search in its `programs` subfolder (tests/test_decode.py
  checks that a second decode.py compiles and traces nothing). In this process, JAX's cache
  options put back after, as tests/helpers.py run_in_process does (the session's cache is set:
  one the load did not change would be seen)."""
  folder = tmp_path / "cache"
  saved = {name: getattr(jax.config, name) for name in JAX_CACHE_OPTIONS}
  assert saved["jax_compilation_cache_dir"] != str(folder)
  try:
    translator = Translator.load(workdirs["transformer"], compilation_cache=str(folder))
    assert len(translator.translate(["w1 w2 w3"], beam_size=2)) == 1
    assert jax.config.jax_enable_compilation_cache is True
    assert jax.config.jax_compilation_cache_dir == str(folder)
  finally:
    for name, value in saved.items():
      jax.config.update(name, value)
  assert len(list((folder / "programs").glob("*.program"))) == 1


def _forced_all(translator, sources, texts, limits) -> list[np.ndarray]:
  """Each token's log-probability of each `texts[i]` (EOS last) given `sources[i]`, by forced
  decoding under the searches' distribution (`score_pairs`, a pass independent of the search),
  the pairs scored together; an EOS at the sentence's length limit `limits[i]` (tokens with EOS)
  costs 0, as the search forces it."""
  scored = []
  for pair, limit in zip(translator.score_pairs(sources, texts, as_search=True), limits):
    tokens = pair.token_log_probs.astype(np.float64)
    if len(tokens) >= limit:
      tokens[-1] = 0.0
    scored.append(tokens)
  return scored


def test_nbest_with_scores_and_scoring_pairs(workdirs):
  """run(num_hypotheses=k): each sentence's k best, best first, with the search's own scores and
  token log-probabilities (no second pass), which forced decoding of the same hypotheses gives
  again: beam search's the log-probability over the paper's ((5 + len) / 6) ** alpha, greedy
  search's the log-probability. float32: the cached search and the full pass round apart in
  bfloat16, which dtype='auto' picks on CPUs with native bfloat16 products."""
  translator = loaded(workdirs["transformer"], "float32")
  sentences = [MORE[0], "", *MORE[1:]]  # test_int8_decoding_...'s, and an empty one
  alpha = 0.6
  result = translator.run(
    sentences, beam_size=3, alpha=alpha, num_hypotheses=3, max_extra_len=3, return_token_scores=True
  )
  assert result.hypotheses[1] == [] and result.scores[1] == [] and result.token_scores[1] == []
  found = []  # (sentence, hypothesis, its score, its tokens' scores) of every hypothesis
  for i, sentence in enumerate(sentences):
    if not sentence:
      continue
    assert len(result.hypotheses[i]) == 3 and result.hypotheses[i][0] == result.texts[i]
    assert result.scores[i] == sorted(result.scores[i], reverse=True)
    found += [(i, *h) for h in zip(result.hypotheses[i], result.scores[i], result.token_scores[i])]
  assert translator.run(sentences, beam_size=3, alpha=alpha, max_extra_len=3).texts == result.texts
  greedy = translator.run(
    sentences[:1], beam_size=1, max_extra_len=3, return_scores=True, return_token_scores=True
  )
  # Forced decoding of every hypothesis and of the greedy one, in one call (one program).
  sources = [sentences[i] for i, *_ in found] + sentences[:1]
  texts = [text for _, text, *_ in found] + greedy.texts
  limits = [len(result.source_ids[i]) + 3 for i, *_ in found] + [len(greedy.source_ids[0]) + 3]
  *forced, expected = _forced_all(translator, sources, texts, limits)
  for (i, text, score, tokens), beam in zip(found, forced):
    np.testing.assert_allclose(tokens, beam, atol=1e-5, err_msg=f"{sentences[i]}: {text}")
    penalty = ((5 + len(beam)) / 6) ** alpha
    assert score == pytest.approx(beam.sum() / penalty, abs=1e-5), (sentences[i], text)
  np.testing.assert_allclose(greedy.token_scores[0][0], expected, atol=1e-5)
  assert greedy.scores == [[pytest.approx(expected.sum(), abs=1e-5)]]
  pooled = translator.run(
    sentences, beam_size=3, alpha=alpha, max_extra_len=3, return_scores=True, batching="continuous"
  )
  assert pooled.scores == [[pytest.approx(s[0], abs=1e-5)] if s else [] for s in result.scores]


def test_continuous_batching_gives_the_same_translations(workdirs):
  """batching='continuous' (a pool of rows, inference/continuous.py) translates a list of mixed
  lengths, with empty and over-long lines, as length batches do."""
  translator = loaded(workdirs["transformer"])
  long = " ".join(f"w{i % 30}" for i in range(40))
  sentences = ["w1 w2 w3", "", long, "w4", "w5 w6 w7 w8 w9 w10", "w3 w2"] * 3
  for search, batches in (
    (dict(beam_size=1), dict(tokens_per_batch=1)),  # test_long_sentences_...'s greedy program
    (dict(beam_size=3, alpha=1.0, length_penalty="fairseq"), {}),
  ):
    pooled = translator.run(sentences, batching="continuous", pool_size=2, **search)
    assert pooled.texts == translator.translate(sentences, **search, **batches), search
    assert pooled.truncated == [2, 8, 14] and pooled.texts[1] == ""
  with pytest.raises(UsageError, match="batching='pool': must be one of"):
    translator.run(sentences, batching="pool")


def test_no_compilation_cache_unless_asked(workdirs, tmp_path, monkeypatch):
  """`compilation_cache` False or None: no program store and no folder made (not one named
  'None' in the working directory)."""
  monkeypatch.chdir(tmp_path)
  for off in (False, None):
    translator = Translator.load(workdirs["transformer"], compilation_cache=off)
    assert translator.generator._programs is None
  assert not any(tmp_path.iterdir())


def test_int8_decoding_quantizes_once_and_stays_close(workdirs):
  """dtype='int8' (decode.py --dtype=int8): the matrices placed once as int8 (model/quantize.py);
  translations mostly those of float32 (tests/test_quantize.py compares the logits); the search's
  scores those forced decoding of the same hypotheses gives in int8; continuous batching equal to
  length batches on these sentences (each row is quantized on its own, but a float32 sum's last
  bits can differ with the batch's shape, and rounding to int8 can make that a step: on a real
  model a rare line parts, docs/experiments.md); decode.py the same as the API; a model whose
  products are not model/layers.py's refused."""
  from model.quantize import Int8Matrix

  sentences = MORE
  stdin = "".join(f"{s}\n" for s in sentences)
  results = {}
  for kind in ("decoder_only", "transformer"):
    # decode.py below reads the decoder_only search back from the program store, as `loaded`
    int8 = Translator.load(workdirs[kind], dtype="int8", compilation_cache=True)
    assert int8.dtype == "int8", int8.dtype
    leaves = jax.tree_util.tree_leaves(int8.params, is_leaf=lambda x: isinstance(x, Int8Matrix))
    assert sum(isinstance(x, Int8Matrix) for x in leaves) >= 6, kind
    results[kind] = int8.run(sentences, beam_size=3, max_extra_len=3, return_scores=True)
  cli = run_in_process(
    "decode.py",
    f"--workdir={workdirs['decoder_only']}",
    "--beam_size=3",
    "--max_extra_len=3",
    "--dtype=int8",
    stdin=stdin,
  )
  assert cli.returncode == 0, cli.stderr[-3000:]
  assert cli.stdout.split("\n")[:-1] == results["decoder_only"].texts
  result = results["transformer"]  # int8 is the transformer's from here on
  exact = loaded(workdirs["transformer"], "float32").translate(  # the n-best test's program
    sentences, beam_size=3, max_extra_len=3
  )
  assert sum(a == b for a, b in zip(result.texts, exact)) >= len(sentences) // 2, result.texts
  settings = int8.settings(max_extra_len=3)
  limits = [len(ids) + settings.max_extra_len for ids in result.source_ids]
  for i, forced in enumerate(_forced_all(int8, sentences, result.texts, limits)):
    penalty = ((5 + len(forced)) / 6) ** settings.alpha
    assert result.scores[i][0] == pytest.approx(forced.sum() / penalty, abs=2e-3), sentences[i]
  pooled = int8.run(sentences, beam_size=3, max_extra_len=3, batching="continuous", pool_size=2)
  assert pooled.texts == result.texts
  weights = int8.attention(result, 0)  # forced through the same int8 matrices
  np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
  with pytest.raises(UsageError, match=r"dtype='int8': int8 products are for model.type .*'rnn'"):
    Translator.load(workdirs["rnn"], dtype="int8")
