"""Beam search in pieces (model/beam_pieces.py) and translate_all's sentences merged across
batches (inference/merged_search.py): the same outputs, to the last bit, as each batch's own
search, with fewer rows searched. A random tiny Transformer (tests/test_generate.py's), cache
segments of 4 positions and pauses at each of their ends from the first (`every_pause`), so
that its short outputs pause twice."""

import functools
import threading

import jax
import numpy as np
import pytest

from inference import merged_search
from inference.generator import Generator
from inference.program_store import ProgramStore
from model import beam_pieces, live_chunks, search
from model.build import abstract_params, build_model
from model.generate import generate
from model.search_settings import SearchSettings
from tests.helpers import Compilations
from tests.test_generate import EOS, EXTRA, SOURCES, padded, random_model

SEGMENT = 4
WIDTH = 12
MAX_LEN = WIDTH + EXTRA  # 16: segment ends 4, 8, 16
SETTINGS = {
  "gnmt-exact": (SearchSettings(beam_size=3, alpha=0.6, max_extra_len=EXTRA), "token_scores"),
  "fairseq-2best": (
    SearchSettings(
      beam_size=4, alpha=1.0, length_penalty="fairseq", num_hypotheses=2, max_extra_len=EXTRA
    ),
    "scores",
  ),
  "gnmt-finished": (
    SearchSettings(beam_size=2, alpha=1.5, stopping="finished", max_extra_len=EXTRA),
    "ids",
  ),
}


REVERSED = [s[-2::-1] + [EOS] for s in SOURCES]  # a second batch: each source's tokens reversed
PAUSE_FROM = merged_search.PAUSE_FROM  # a real batch's earliest pause, as a share of its width


@pytest.fixture(autouse=True)
def every_pause(monkeypatch):
  """This file's batches pause at every segment end up to their width, the earliest too: their
  short outputs would end before a real batch's first pause (a quarter of the width)."""
  monkeypatch.setattr(merged_search, "PAUSE_FROM", 0)


@functools.cache
def tiny_model():
  """The tiny Transformer and its parameters, one for this file and tests/test_live_chunks.py:
  the programs `_kept` holds for it serve both."""
  return random_model(num_layers=1, seed=2, eos_bias=3.4)


@pytest.fixture(scope="module")
def tiny():
  return tiny_model()


# Jitted searches and generators kept across tests (this file's and tests/test_live_chunks.py's),
# so that a program is traced and compiled once, not once per test. Keyed by the model's id (each
# value holds the model: the id is not reused) and by live_chunks' sizes, which the traced steps
# read (a chunk is chosen when traced; `chunks=False`: a program that steps no chunks).
_KEPT: dict = {}


def _kept(*key, make, chunks=True):
  if chunks:
    key = (*key, live_chunks.CHUNK_ROWS, live_chunks.MIN_CHUNK_ROWS, live_chunks.MIN_CHUNKS)
  if key not in _KEPT:
    _KEPT[key] = make()
  return _KEPT[key]


def _pieces(model, settings, outputs, segment=SEGMENT):
  """Jitted begin and resume of `beam_pieces`, and the pause steps for MAX_LEN."""
  keywords = dict(outputs=outputs, segment=segment)

  def make():
    begin = jax.jit(
      lambda p, x, until: beam_pieces.begin(model, p, x, settings, MAX_LEN, until, **keywords),
      static_argnums=2,
    )
    resume = jax.jit(
      lambda p, x, a, b: beam_pieces.resume(model, p, x, settings, MAX_LEN, a, b, **keywords),
      static_argnums=(2, 3),
    )
    return begin, resume, search.pause_steps(MAX_LEN, segment)

  return _kept("pieces", id(model), settings, outputs, segment, make=make)


def _generate(model, settings, outputs):
  """Jitted `generate` to MAX_LEN over cache segments of SEGMENT: (outputs, step counts). It
  steps every row (chunks are `beam_pieces`'), the same program for test_live_chunks.py."""

  def make():
    return jax.jit(
      lambda p, x: generate(
        model, p, x, None, settings, MAX_LEN, outputs, segment=SEGMENT, count_steps=True
      )
    )

  return _kept("generate", id(model), settings, outputs, make=make, chunks=False)


def _generator(model, **options):
  """A `Generator(model, segment=SEGMENT, **options)` kept across tests: its programs compiled
  once (read its `rows_searched` right after its `translate_all`)."""
  options = dict(segment=SEGMENT, **options)
  key = ("generator", id(model), tuple(sorted(options.items())))
  return _kept(*key, make=lambda: Generator(model, **options))


def _arrays(found) -> list:
  """A search's outputs (ids, or a tuple of ids, scores...) as a list of numpy arrays."""
  return [np.asarray(x) for x in (found if isinstance(found, (tuple, list)) else [found])]


def _equal(a, b) -> bool:
  a, b = _arrays(a), _arrays(b)
  return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def test_pauses_are_the_cache_segment_ends():
  """A search pauses where its cache grows (no loop more than one search in one piece compiles);
  a cache that never grows, or a pause off the segment ends, is refused by the loop."""
  assert search.pause_steps(82, 16) == [16, 32, 64] and search.pause_steps(36, 16) == [16]
  assert search.pause_steps(16, 16) == [] and search.pause_steps(16, None) == []
  with pytest.raises(ValueError, match=r"steps 16\.\.24 do not fall on the segment ends"):
    search.segmented_loop(None, None, None, 82, 16, lambda c, n: c, start=16, until=24)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_a_search_in_pieces_is_generates_search_to_the_last_bit(tiny, name):
  """begin -> resume -> resume at the segment ends gives `generate`'s outputs and step counts;
  an entry done at a pause already has its final outputs; entries of two batches joined into
  one piece at a pause go on to their own batch's outputs."""
  model, params = tiny
  settings, outputs = SETTINGS[name]
  begin, resume, pauses = _pieces(model, settings, outputs)
  assert pauses == [4, 8]
  whole = _generate(model, settings, outputs)
  batches = [padded(SOURCES), padded(REVERSED)]  # of 8: test_live_chunks.py's (its programs)
  expected = [whole(params, x) for x in batches]
  paused, done_at_8 = [], []
  for x, (found, steps) in zip(batches, expected):
    piece, _ = begin(params, x, 4)
    piece, at_8 = resume(params, piece, 4, 8)
    paused.append(piece)
    done = np.asarray(piece.state.done)
    done_at_8 += list(done)
    assert _equal([x[done] for x in _arrays(at_8)], [x[done] for x in _arrays(found)])
    piece, last = resume(params, piece, 8, MAX_LEN)
    assert _equal(last, found)
    np.testing.assert_array_equal(piece.state.searched, steps)
  assert any(done_at_8) and not all(done_at_8)

  host = [jax.tree_util.tree_map(np.asarray, p) for p in paused]
  picks = [(1, 3), (0, 1), (1, 0), (0, 2), (0, 7), (1, 6), (0, 4), (1, 5)]  # both's, out of order
  joined = beam_pieces.join([beam_pieces.entry(host[b], r) for b, r in picks])
  _, last = resume(params, jax.device_put(joined), 8, MAX_LEN)
  for row, (b, r) in enumerate(picks):
    assert _equal([x[row] for x in _arrays(last)], [x[r] for x in _arrays(expected[b][0])])


@pytest.mark.parametrize("name", list(SETTINGS))
def test_a_last_piece_across_segment_ends_is_one_loop(tiny, name):
  """A piece resumed at the first pause and searched to MAX_LEN, across a later segment end,
  grows its cache to every position at once and runs one loop (one program's loop, not one per
  segment): `generate`'s ids and step counts, the scores to a few units in the last place (the
  attention sums over more positions, masked)."""
  model, params = tiny
  settings, outputs = SETTINGS[name]
  begin, resume, pauses = _pieces(model, settings, outputs)
  x = padded(SOURCES)
  found, steps = _generate(model, settings, outputs)(params, x)
  piece, _ = begin(params, x, pauses[0])
  hlo = resume.lower(params, piece, pauses[0], MAX_LEN).as_text()
  assert hlo.count("stablehlo.while") == 1
  piece, last = resume(params, piece, pauses[0], MAX_LEN)
  np.testing.assert_array_equal(piece.state.searched, steps)
  got, want = _arrays(last), _arrays(found)
  np.testing.assert_array_equal(got[0], want[0])
  for a, b in zip(got[1:], want[1:], strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_a_recurrent_model_pauses_without_growing(tiny):
  """A model whose cache has no buffers to grow (recurrent state) pauses at the same steps."""
  from configs.common import base_config

  cfg = base_config().model
  cfg.update(dict(type="rnn", vocab_size=24, d_model=16, num_layers=1))
  model = build_model(cfg)
  shapes = abstract_params(cfg)
  rng = np.random.default_rng(0)
  params = jax.tree_util.tree_map(
    lambda s: (0.5 * rng.standard_normal(s.shape)).astype(np.float32), shapes
  )
  settings, outputs = SETTINGS["gnmt-exact"]
  begin, resume, _ = _pieces(model, settings, outputs)
  x = padded(SOURCES[:4])
  found, _ = _generate(model, settings, outputs)(params, x)
  piece, _ = begin(params, x, 4)
  piece, _ = resume(params, piece, 4, 8)
  _, last = resume(params, piece, 8, MAX_LEN)
  assert _equal(last, found)


def _sentences(count: int, seed: int = 0) -> list:
  """`count` distinct sentences of 3-11 tokens (EOS included): one length bucket."""
  rng = np.random.default_rng(seed)
  return [list(rng.integers(3, 24, int(n) - 1)) + [EOS] for n in rng.integers(3, 12, count)]


def _nested(outputs) -> list:
  """translate_all's outputs (ids arrays, lists of them, or NBest) as nested lists."""
  flat = []
  for out in outputs:
    if hasattr(out, "scores"):
      tokens = [] if out.token_scores is None else [t.tolist() for t in out.token_scores]
      flat.append(([i.tolist() for i in out.ids], out.scores.tolist(), tokens))
    elif isinstance(out, list):
      flat.append([i.tolist() for i in out])
    else:
      flat.append(out.tolist())
  return flat


@pytest.mark.parametrize(
  "name, parallel, how",
  [
    ("gnmt-exact", 1, dict(token_scores=True)),
    ("fairseq-2best", 3, {}),
    ("gnmt-finished", 2, dict(scores=True)),
  ],
)
def test_translate_all_merges_sentences_still_searching_across_batches(tiny, name, parallel, how):
  """translate_all with `merge` (the default) returns every sentence's outputs exactly as each
  batch on its own does, whatever `parallel_batches`, and searches fewer rows x steps for the
  same rows x steps needed; progress is reported up to every sentence."""
  model, params = tiny
  settings, _ = SETTINGS[name]
  sentences = _sentences(60)
  options = dict(tokens_per_batch=4 * 32, parallel_batches=parallel, **how)  # 15 batches of 4
  alone = _generator(model, merge=False)
  expected = alone.translate_all(params, sentences, settings, **options)
  alone_computed, alone_needed = alone.rows_searched
  progress = []
  merged = _generator(model)
  found = merged.translate_all(params, sentences, settings, on_batch=progress.append, **options)
  assert _nested(found) == _nested(expected)
  computed, needed = merged.rows_searched
  assert needed == alone_needed and computed < alone_computed
  assert progress == sorted(progress) and progress[-1] == len(sentences)


def test_a_batch_pauses_past_a_quarter_of_its_source_width(monkeypatch):
  """A real batch (not this file's) pauses at the segment ends past a quarter of its padded
  source width and up to it: few outputs end before, and each pause is a program more."""
  monkeypatch.setattr(merged_search, "PAUSE_FROM", PAUSE_FROM)
  stops, least = merged_search.piece_stops, merged_search.MIN_PIECES
  assert stops((16, 32), 82, 16, 16 * least) == [16, 32, 82]
  assert stops((16, 64), 114, 16, 16 * least) == [32, 64, 114]
  assert stops((4, 128), 178, 16, 4 * least) == [64, 128, 178]  # later pieces of 4


@pytest.mark.parametrize("name", list(SETTINGS))
def test_few_batches_of_a_shape_are_searched_whole(tiny, name, monkeypatch):
  """A shape whose sentences fill fewer than MIN_PIECES later pieces, however its batches were
  cut, is searched in one piece: nothing waits, one program, whose self-attention buffers hold
  every position from the start (no growing segments); its outputs are the segmented search's,
  the scores to a few units in the last place (attention sums over more, masked positions).
  Bigger batches of such a shape are cut again to the later pieces' size: the same search, by
  the same program."""
  stops, least = merged_search.piece_stops, merged_search.MIN_PIECES
  assert stops((16, 32), 82, 16, 16 * (least - 1)) == [82]  # later pieces of 16 sentences
  assert stops((64, 32), 82, 16, 16 * (least - 1)) == [82]  # however the batches were cut
  assert stops((16, 32), 82, 16, 16 * (least - 1) + 1) == [16, 32, 82]  # none past the source
  assert stops((16, 64), 114, 16, 16 * least) == [16, 32, 64, 114]  # this file's: every end
  model, params = tiny
  settings, outputs = SETTINGS[name]
  how = {outputs: True} if outputs != "ids" else {}
  sentences = _sentences(4 * (merged_search.MIN_PIECES - 1), seed=1)
  segments = []
  begin = beam_pieces.begin
  monkeypatch.setattr(
    beam_pieces, "begin", lambda *a, **k: segments.append(k["segment"]) or begin(*a, **k)
  )
  generator = Generator(model, segment=SEGMENT)
  with Compilations("jit(_piece)") as compiled:
    found = generator.translate_all(params, sentences, settings, tokens_per_batch=4 * 32, **how)
  rows = generator.rows_searched
  expected = _generator(model, merge=False).translate_all(
    params, sentences, settings, tokens_per_batch=4 * 32, **how
  )
  assert len(found) == len(expected) and compiled.count == 1 and segments == [None]
  monkeypatch.setattr(merged_search, "LATER_BATCH", 4)  # batches of 16 cut again into 4s
  with Compilations("jit(_piece)") as compiled:  # the same generator: the same program
    again = generator.translate_all(params, sentences, settings, tokens_per_batch=16 * 32, **how)
  assert _nested(again) == _nested(found) and generator.rows_searched == rows
  assert compiled.count == 0  # cut to the shape searched above, its program
  for got, want in zip(_nested(found), _nested(expected)):  # ids equal, sums rounded apart
    if not isinstance(got, tuple):
      assert got == want
      continue
    assert got[0] == want[0]
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=1e-6)
    for a, b in zip(got[2], want[2], strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  computed, needed = rows
  assert computed > needed  # batch by batch


def test_merged_pieces_are_kept_on_disk_and_read_back_untraced(tiny, tmp_path, monkeypatch):
  """With a program store, a file's piece programs (begin at the batches' shape, each resume at
  the later pieces', here smaller) are compiled once, kept, and read back by a later generator
  that traces nothing at all (no program of its own, no jnp operation between the pieces); the
  outputs are the same."""
  model, params = tiny
  settings, _ = SETTINGS["gnmt-finished"]
  sentences = _sentences(40, seed=2)
  monkeypatch.setattr(merged_search, "LATER_BATCH", 4)
  options = dict(tokens_per_batch=8 * 32, parallel_batches=2)  # 5 batches of 8, later pieces of 4
  # Each batch of 4 alone: on a CPU the batches of 8 are cut to the later pieces' 4 from the first
  # piece on (test_later_stages_go_on_in_smaller_batches), and ids are compared, not scores.
  expected = _generator(model, merge=False).translate_all(
    params, sentences, settings, tokens_per_batch=4 * 32
  )
  store = ProgramStore(tmp_path)
  found = Generator(model, segment=SEGMENT, programs=store).translate_all(
    params, sentences, settings, **options
  )
  pieces = len(search.pause_steps(32 + EXTRA, SEGMENT)) + 1  # 0-4, 4-8, 8-16, 16-32, 32-36
  assert _nested(found) == _nested(expected) and store.compiled == pieces == 5
  assert Generator(model, programs=store).translate_all(params, [], settings) == []
  again = ProgramStore(tmp_path)
  jax.clear_caches()  # so that anything the run asks JAX for is traced again, and counted
  traced = Compilations(None, Compilations.TRACED)
  with traced:
    found = Generator(model, segment=SEGMENT, programs=again).translate_all(
      params, sentences, settings, **options
    )
  assert _nested(found) == _nested(expected)
  assert (traced.count, again.loaded, again.compiled) == (0, pieces, 0)


def test_pieces_are_searched_while_later_programs_are_fetched(tiny, tmp_path, monkeypatch):
  """The piece programs are fetched (here compiled) one after another in the order the pieces
  first need them, while the pieces whose programs are ready are searched: the first piece is
  searched before the last stage's program is fetched (a fetch waits up to 30 s for it), and
  every program is fetched by the time translate_all returns. On a CPU the batches of 8 are cut
  to the later pieces' 4 from the first piece on."""
  from inference import generator as generator_module

  model, params = tiny
  settings, _ = SETTINGS["gnmt-finished"]
  sentences = _sentences(40, seed=2)
  monkeypatch.setattr(merged_search, "LATER_BATCH", 4)
  events, searched = [], threading.Event()

  class Recording(ProgramStore):
    def __call__(self, signature, lower, device=None, what=None):
      if what.endswith("steps 32-36"):
        searched.wait(timeout=30)
      events.append(what)
      return super().__call__(signature, lower, device, what)

  def recording(run, *args):
    def run_and_record(shape, x, start, until):
      found = run(shape, x, start, until)
      events.append(f"searched {start}-{until}")
      searched.set()
      return found

    return merged_search.merged_translate(run_and_record, *args)

  monkeypatch.setattr(generator_module, "merged_translate", recording)
  store = Recording(tmp_path)
  generator = Generator(model, segment=SEGMENT, programs=store)
  generator.translate_all(params, sentences, settings, tokens_per_batch=8 * 32)
  fetched = [e for e in events if e.startswith("int32")]
  stages = ["0-4", "4-8", "8-16", "16-32", "32-36"]
  assert fetched == [f"int32[4,32], steps {s}" for s in stages], events
  assert events.index("searched 0-4") < events.index(fetched[-1]), events
  assert store.compiled == len(stages)


def test_later_stages_go_on_in_smaller_batches(tiny, monkeypatch):
  """After the first pause, entries of batches of 8 go on in pieces of at most LATER_BATCH
  sentences and LATER_TOKENS source tokens (their first piece at the batch's own shape, with
  `cut_first=False`); every sentence gets its batch's outputs, and smaller later pieces search
  fewer rows x steps. On a CPU (`cut_first` None) the first pieces take the later size too: the
  search of batches of 8 is the search of batches of that size, and the same translations."""
  from inference import generator as generator_module

  model, params = tiny
  settings, _ = SETTINGS["gnmt-exact"]
  sentences = _sentences(64, seed=3)
  options = dict(tokens_per_batch=8 * 32, token_scores=True)  # 8 batches of 8, one at a time
  alone = _generator(model, merge=False)
  expected = alone.translate_all(params, sentences, settings, **options)
  alone_needed = alone.rows_searched[1]
  shapes = []

  def recording(run, *args):
    def run_and_record(shape, x, start, until):
      shapes.append((shape, start))
      return run(shape, x, start, until)

    return merged_search.merged_translate(run_and_record, *args)

  monkeypatch.setattr(generator_module, "merged_translate", recording)
  rows = []
  generator = _generator(model, cut_first=False)
  for later_batch, later_tokens, later in [(8, 512, 8), (2, 512, 2), (8, 64, 2)]:
    monkeypatch.setattr(merged_search, "LATER_BATCH", later_batch)
    monkeypatch.setattr(merged_search, "LATER_TOKENS", later_tokens)
    shapes.clear()
    found = generator.translate_all(params, sentences, settings, **options)
    assert _nested(found) == _nested(expected)
    assert {s for s, start in shapes if start == 0} == {(8, 32)}
    assert {s for s, start in shapes if start > 0} == {(later, 32)}
    rows.append(generator.rows_searched)
  assert {needed for _, needed in rows} == {alone_needed}
  assert rows[0][0] > rows[1][0] == rows[2][0]
  shapes.clear()  # the last setting (later pieces of 2) on a CPU: batches of 2 from the start
  on_cpu = _generator(model)
  found = on_cpu.translate_all(params, sentences, settings, **options)
  assert {s for s, _ in shapes} == {(2, 32)}
  small = generator  # cut_first=False, batches of 2
  cut = small.translate_all(params, sentences, settings, **dict(options, tokens_per_batch=2 * 32))
  assert _nested(found) == _nested(cut) and on_cpu.rows_searched == small.rows_searched
  assert [x[0] for x in _nested(found)] == [x[0] for x in _nested(expected)]  # texts
