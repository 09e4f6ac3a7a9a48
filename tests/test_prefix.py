"""Decoding from a target prefix: model/search.py's forced tokens through model/generate.py,
model/pool.py, inference/generator.py and inference/continuous.py, on tiny random float32 models.

Checked against independent computations: every hypothesis starts with its prefix; its scores are
forced decoding's (model/forced_scoring.py, the searches' distribution) of the whole hypothesis, the
prefix included, over the length penalty in beam search; greedy search's continuation is the
argmax of the teacher-forced logits after the prefix; a sentence with an empty prefix is decoded
exactly as without one; continuous batching gives what the length batches give. The command line
and the Python API (tests/test_translator.py's workdirs) and CTranslate2's `target_prefix`
(tests/test_ctranslate2.py) are checked there.
"""

import functools

import jax
import numpy as np
import pytest

from core.errors import UsageError
from inference import Translator, continuous
from inference.generator import Generator
from model import forced_scoring, search
from model.generate import strip
from model.length_buckets import padded
from model.search_settings import SearchSettings
from model.special_tokens import EOS_ID, PAD_ID
from tests.helpers import MODEL_TYPES, run_in_process
from tests.test_continuous import EXTRA, SENTENCES, tiny

SOURCES = SENTENCES[:6]
PREFIXES = [[5, 7], [], [9], [4, 4, 4], [12, 3, 8, 10, 6, 11, 2], []]
# > the longest prefix: every row ends in PAD; Generator.translate_all's width of these prefixes
# (model/length_buckets.py prefix_width), so that it runs the programs of `_search` below.
WIDTH = 32
SETTINGS = {
  "greedy": SearchSettings(beam_size=1, max_extra_len=EXTRA),
  "gnmt": SearchSettings(beam_size=3, alpha=1.5, max_extra_len=EXTRA, num_hypotheses=3),
  "fairseq": SearchSettings(
    beam_size=3, alpha=1.0, length_penalty="fairseq", max_extra_len=EXTRA, num_hypotheses=3
  ),
  "sampling": SearchSettings(beam_size=1, temperature=1.0, top_k=5, max_extra_len=EXTRA),
}


def _search(generator, params, settings, prefixes=PREFIXES):
  """(ids [n, hyps, width], scores [n, hyps], token scores [n, hyps, width]) of SOURCES."""
  prefix = None if prefixes is None else padded(prefixes, WIDTH)
  ids, scores, tokp = generator(
    params, padded(SOURCES, 32), settings, prefix=prefix, token_scores=True
  )
  ids, scores, tokp = (np.asarray(x) for x in (ids, scores, tokp))
  if ids.ndim == 2:
    ids, scores, tokp = ids[:, None], scores[:, None], tokp[:, None]
  return ids, scores, tokp


def _hypothesis(row) -> list[int]:
  """A hypothesis' tokens up to and including EOS (all of them when cut at the limit)."""
  row = list(row)
  return row[: row.index(EOS_ID) + 1] if EOS_ID in row else [t for t in row if t != PAD_ID]


ROWS = 3 * len(SOURCES)  # the most hypotheses the searches above return


@functools.partial(jax.jit, static_argnums=(0, 4))
def _forced_program(model, params, sources, targets, ensemble):
  tokp, _ = forced_scoring.score(model, params, sources, targets, ensemble=ensemble, as_search=True)
  logits = None if ensemble else model.apply({"params": params}, sources, targets)
  return tokp, logits


def _forced(model, params, hypotheses, ensemble=False):
  """Forced decoding of each (source, hypothesis) under the searches' distribution: token
  log-probabilities [n, width] and the teacher-forced float32 logits (one model only); computed
  over `ROWS` rows (the first repeated), one program per model."""
  rows = [(SOURCES[i], h) for i, h in hypotheses]
  rows += rows[:1] * (ROWS - len(rows))
  sources = padded([source for source, _ in rows], 32)
  targets = padded([h for _, h in rows], 64)
  tokp, logits = _forced_program(model, params, sources, targets, ensemble)
  n = len(hypotheses)
  return np.asarray(tokp)[:n], None if logits is None else np.asarray(logits)[:n]


@pytest.fixture(scope="module")
def transformer():
  model, params = tiny("transformer")
  return model, params, Generator(model, segment=None)  # one loop a program: compiles faster


@pytest.mark.parametrize("name", SETTINGS)
def test_hypotheses_start_with_the_prefix_and_score_as_forced_decoding(transformer, name):
  model, params, generator = transformer
  settings = SETTINGS[name]
  ids, scores, tokp = _search(generator, params, settings)
  hyps = []
  for i, prefix in enumerate(PREFIXES):
    for h in range(ids.shape[1]):
      if np.isfinite(scores[i, h]):
        hyp = _hypothesis(ids[i, h])
        assert hyp[: len(prefix)] == prefix, (name, i, h)
        assert len(hyp) <= max(len(SOURCES[i]), len(prefix) + 1) + EXTRA
        hyps.append((i, h, hyp))
  forced, _ = _forced(model, params, [(i, hyp) for i, _, hyp in hyps])
  for row, (i, h, hyp) in enumerate(hyps):
    n = len(hyp)
    want = forced[row, :n].copy()
    if n == max(len(SOURCES[i]), len(PREFIXES[i]) + 1) + EXTRA and hyp[-1] == EOS_ID:
      want[-1] = 0.0  # an EOS forced at the length limit costs 0, as in the search
    np.testing.assert_allclose(tokp[i, h, :n], want, rtol=1e-5, atol=1e-5)
    total = want.sum()
    if settings.beam_size > 1:
      total /= search.length_penalty(n, settings.alpha, settings.length_penalty)
    np.testing.assert_allclose(scores[i, h], total, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["greedy", "fairseq"])
def test_the_ctranslate2_rule_scores_the_continuation_alone(transformer, name):
  """prefix_rule='ctranslate2': the prefix's tokens score 0, the continuation's tokens as forced
  decoding scores them, and beam search's score is their sum over the whole hypothesis' length
  penalty; no beam hypothesis ends right at a non-empty prefix unless EOS is the best token
  there (greedy search's choice)."""
  model, params, generator = transformer
  settings = SETTINGS[name].replace(prefix_rule="ctranslate2")
  ids, scores, tokp = _search(generator, params, settings)
  greedy = _search(generator, params, SETTINGS["greedy"])[0]
  hyps = [(i, h, _hypothesis(ids[i, h])) for i in range(len(SOURCES)) for h in range(ids.shape[1])]
  hyps = [(i, h, hyp) for i, h, hyp in hyps if np.isfinite(scores[i, h])]
  forced, _ = _forced(model, params, [(i, hyp) for i, _, hyp in hyps])
  for row, (i, h, hyp) in enumerate(hyps):
    n, p = len(hyp), len(PREFIXES[i])
    assert hyp[:p] == PREFIXES[i]
    want = forced[row, :n].copy()
    want[:p] = 0.0
    if n == max(len(SOURCES[i]), p + 1) + EXTRA and hyp[-1] == EOS_ID:
      want[-1] = 0.0  # an EOS forced at the length limit costs 0, as in the search
    np.testing.assert_allclose(tokp[i, h, :n], want, rtol=1e-5, atol=1e-5)
    total = want.sum()
    if settings.beam_size > 1:
      total /= search.length_penalty(n, settings.alpha, settings.length_penalty)
      if n == p + 1:  # ended right at the prefix: EOS was the best token there
        assert _hypothesis(greedy[i, 0]) == hyp, (i, h)
    np.testing.assert_allclose(scores[i, h], total, rtol=1e-5, atol=1e-5)


def test_greedy_goes_on_from_the_prefix_by_the_teacher_forced_argmax(transformer):
  model, params, generator = transformer
  ids, _, _ = _search(generator, params, SETTINGS["greedy"])
  hyps = [(i, _hypothesis(ids[i, 0])) for i in range(len(SOURCES))]
  _, logits = _forced(model, params, hyps)
  logits = logits.copy()
  logits[..., PAD_ID] = -np.inf
  for row, (i, hyp) in enumerate(hyps):
    free = range(len(PREFIXES[i]), len(hyp) - 1)  # the last token may be a forced EOS
    assert [hyp[t] for t in free] == [int(np.argmax(logits[row, t])) for t in free], i
  assert any(len(h) > len(PREFIXES[i]) + 1 for i, h in hyps)  # the search did go on


@pytest.mark.parametrize("name", SETTINGS)
def test_an_empty_prefix_changes_nothing(transformer, name):
  _, params, generator = transformer
  with_prefix = _search(generator, params, SETTINGS[name])
  without = _search(generator, params, SETTINGS[name], prefixes=None)
  empty = [i for i, p in enumerate(PREFIXES) if not p]
  for got, want in zip(with_prefix, without):
    np.testing.assert_array_equal(got[empty], want[empty])
  all_empty = _search(generator, params, SETTINGS[name], prefixes=[[]] * len(SOURCES))
  for got, want in zip(all_empty, without):
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kind", MODEL_TYPES)
def test_every_model_type_and_an_ensemble_follow_the_prefix(kind):
  model, params = tiny(kind)
  ensemble = kind == "transformer"
  if ensemble:
    params = jax.tree_util.tree_map(lambda a, b: np.stack([a, b]), params, tiny(kind, 7)[1])
  generator = Generator(model, ensemble=ensemble)
  ids, scores, tokp = _search(generator, params, SETTINGS["greedy"])
  hyps = [(i, _hypothesis(ids[i, 0])) for i in range(len(SOURCES))]
  for (_, hyp), prefix in zip(hyps, PREFIXES):
    assert hyp[: len(prefix)] == prefix
  forced, _ = _forced(model, params, hyps, ensemble=ensemble)
  for row, (i, _) in enumerate(hyps):
    n = len(PREFIXES[i])
    np.testing.assert_allclose(tokp[i, 0, :n], forced[row, :n], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
  "name, rule", [("greedy", "forced"), ("gnmt", "forced"), ("fairseq", "ctranslate2")]
)
def test_continuous_batching_equals_the_length_batches(transformer, name, rule):
  """Through a pool of 3 (fewer than the sentences), each sentence's hypotheses and their
  scores are those `Generator.translate_all` finds from the same prefix, best first, each
  starting with its prefix."""
  model, params, generator = transformer
  settings = SETTINGS[name].replace(prefix_rule=rule)
  batched = generator.translate_all(
    params, SOURCES, settings, prefixes=PREFIXES, token_scores=True
  )  # the programs of `_search`: the same shapes and settings
  pooled = {
    h.index: h
    for h in continuous.decode_continuous(
      model, params, SOURCES, settings, source_len=32, pool_size=3, prefixes=PREFIXES
    )
  }
  assert sorted(pooled) == list(range(len(SOURCES)))
  for i, want in enumerate(batched):
    assert list(want.ids[0][: len(PREFIXES[i])]) == PREFIXES[i]
    assert [strip(row).tolist() for row in pooled[i].ids] == [h.tolist() for h in want.ids]
    np.testing.assert_allclose(pooled[i].scores, want.scores, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
  "prefix, message",
  [
    ([[5, EOS_ID, 0]], "prefix[0, 1]=1: a prefix token must be above EOS"),
    ([[5, 0, 6, 0]], "prefix[0]: must be tokens then PAD"),
    ([[5, 6]], "P=2 must exceed the longest prefix"),
    ([[5, 99, 0]], "prefix[0, 1]=99: a prefix token must be above EOS (1) and below 24"),
    ([[5, 6, 0], [5, 0, 0]], "prefix: must be [batch=1, P] integer ids"),
  ],
)
def test_bad_prefixes_are_refused_in_one_line(transformer, prefix, message):
  _, params, generator = transformer
  with pytest.raises(ValueError) as e:
    generator(params, padded(SOURCES[:1], 32), SETTINGS["greedy"], prefix=np.array(prefix))
  assert message in str(e.value) and "\n" not in str(e.value)
  with pytest.raises(ValueError, match="prefixes: 1 given for 2 sentences"):
    continuous.translate_continuous(
      transformer[0], params, SOURCES[:2], source_len=32, prefixes=[[5]]
    )


@pytest.mark.slow
def test_the_api_and_decode_py_translate_from_a_prefix(uninterrupted, tmp_path):
  """Translator.run(target_prefixes=...) and decode.py --target_prefix give the same
  translations (with either prefix_rule), each starting with its prefix's text (an empty prefix,
  or an empty sentence, as without); a prefix file of another length is one line naming both
  counts, before any decoding. decode.py run in this process reads the API's compiled searches
  back from the program store (the session's cache folder, conftest's $JAX_COMPILATION_CACHE_DIR:
  decode.py's default, so JAX's options stay as they were), as a second run does: the two differ
  only in what is around the search."""
  _, workdir = uninterrupted
  translator = Translator.load(workdir, dtype="float32", compilation_cache=True)
  sources = ["w1 w2 w3", "", "w5 w6 w7 w8", "w3 w4", "w2 w9 w4 w1"]
  prefixes = ["w9 w9", "w1", "", "w2", "w7 w7 w7"]
  how = dict(beam_size=2, max_extra_len=4)
  got = translator.run(sources, target_prefixes=prefixes, return_scores=True, **how)
  plain = translator.run(sources, return_scores=True, **how)
  for i, (text, prefix) in enumerate(zip(got.texts, prefixes)):
    if not sources[i]:
      assert text == ""
    elif not prefix:
      assert (text, got.scores[i]) == (plain.texts[i], plain.scores[i])
    else:
      assert text.split()[: len(prefix.split())] == prefix.split(), (text, prefix)
  pooled = translator.run(sources, target_prefixes=prefixes, batching="continuous", **how)
  assert pooled.texts == got.texts
  (tmp_path / "in.txt").write_text("".join(s + "\n" for s in sources))
  (tmp_path / "prefix.txt").write_text("".join(p + "\n" for p in prefixes))
  flags = [f"--workdir={workdir}", f"--input={tmp_path / 'in.txt'}", "--dtype=float32"]
  flags += ["--beam_size=2", "--max_extra_len=4"]
  ran = run_in_process("decode.py", *flags, f"--target_prefix={tmp_path / 'prefix.txt'}")
  assert ran.returncode == 0, ran.stderr[-2000:]
  assert ran.stdout.splitlines() == got.texts
  rule = translator.run(sources, target_prefixes=prefixes, prefix_rule="ctranslate2", **how)
  ran = run_in_process(
    "decode.py", *flags, f"--target_prefix={tmp_path / 'prefix.txt'}", "--prefix_rule=ctranslate2"
  )
  assert ran.returncode == 0, ran.stderr[-2000:]
  assert ran.stdout.splitlines() == rule.texts
  (tmp_path / "short.txt").write_text("w1\n")
  ran = run_in_process("decode.py", *flags, f"--target_prefix={tmp_path / 'short.txt'}")
  last = ran.stderr.strip().splitlines()[-1]
  assert ran.returncode == 2 and "has 1 lines, the input has 5" in last, ran.stderr[-2000:]
  with pytest.raises(UsageError, match="target_prefixes: 1 given for 5 sentences"):
    translator.run(sources, target_prefixes=["w1"])
