"""Beam search steps over the chunks of sentences still searching (model/live_chunks.py): the same
search as stepping the whole batch, with fewer rows computed. A random tiny Transformer
(tests/test_generate.py's), cache segments of 4 positions; chunks made small (CHUNK_ROWS) so
that its short batches are split. A chunk's products run over fewer rows than the batch's, which
XLA:CPU may round differently: ids are compared exactly, scores to a few units in the last
place."""

import dataclasses

import jax
import numpy as np
import pytest

from inference.generator import Generator
from model import beam_pieces, live_chunks
from tests.test_generate import SOURCES, padded
from tests.test_merged_search import (
  MAX_LEN,
  SEGMENT,
  SETTINGS,
  _arrays,
  _generate,
  _generator,
  _nested,
  _pieces,
  _sentences,
  tiny_model,
)


def _same_search(found: list, expected: list):
  """Equal ids (the first array), scores and token scores within 1e-6."""
  np.testing.assert_array_equal(found[0], expected[0])
  assert len(found) == len(expected)
  for got, want in zip(found[1:], expected[1:]):
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def _chunks_of(monkeypatch, rows: int):
  """Chunks of `rows` rows, at most and at least (the tiny batches are short)."""
  monkeypatch.setattr(live_chunks, "CHUNK_ROWS", rows)
  monkeypatch.setattr(live_chunks, "MIN_CHUNK_ROWS", rows)


@pytest.fixture(scope="module")
def tiny():
  return tiny_model()


def test_a_chunk_is_a_divisor_of_the_batch_with_rows_enough(monkeypatch):
  """The largest divisor of the batch with at most CHUNK_ROWS rows and a MIN_CHUNKS-th of the
  batch's sentences, at least MIN_CHUNK_ROWS rows; None when there is none (stepped whole)."""
  size = live_chunks.chunk_size
  assert (live_chunks.CHUNK_ROWS, live_chunks.MIN_CHUNK_ROWS, live_chunks.MIN_CHUNKS) == (40, 16, 4)
  assert [size(16, 5), size(64, 5), size(16, 4), size(8, 8), size(24, 5)] == [4, 8, 4, 2, 6]
  assert [size(8, 5), size(6, 5), size(4, 5), size(9, 5), size(16, 1), size(1, 5)] == [None] * 6
  monkeypatch.setattr(live_chunks, "CHUNK_ROWS", 8)
  monkeypatch.setattr(live_chunks, "MIN_CHUNK_ROWS", 4)
  assert [size(8, 3), size(8, 4), size(8, 2), size(7, 2), size(16, 2)] == [2, 2, 2, None, 4]


@pytest.mark.parametrize("name", list(SETTINGS))
def test_chunks_give_the_whole_batchs_search_with_fewer_rows(tiny, name, monkeypatch):
  """A batch searched in chunks of 2 sentences (begin -> resume at the segment ends) gives
  `generate`'s outputs and step counts, and computes fewer rows x steps than the whole batch's
  loop, sentences done being left out."""
  model, params = tiny
  settings, outputs = SETTINGS[name]
  _chunks_of(monkeypatch, 2 * settings.beam_size)
  x = padded(SOURCES)  # 8 sentences: 4 chunks of 2
  assert live_chunks.chunk_size(len(SOURCES), settings.beam_size) == 2
  found, steps = _generate(model, settings, outputs)(params, x)
  begin, resume, _ = _pieces(model, settings, outputs)
  piece, _ = begin(params, x, 4)
  piece, _ = resume(params, piece, 4, 8)
  piece, last = resume(params, piece, 8, MAX_LEN)
  _same_search(_arrays(last), _arrays(found))
  np.testing.assert_array_equal(piece.state.searched, steps)
  computed = np.asarray(piece.state.computed)
  whole = len(SOURCES) * int(piece.state.t)
  assert computed.sum() < whole and np.all(computed >= np.asarray(steps))


def test_translate_all_counts_the_rows_chunks_computed(tiny, monkeypatch):
  """translate_all's merged search with chunks: every sentence's outputs as each batch on its own
  gives them, the same rows x steps needed, fewer searched than without chunks."""
  model, params = tiny
  settings, _ = SETTINGS["fairseq-2best"]
  sentences = _sentences(48, seed=4)
  options = dict(tokens_per_batch=8 * 32, scores=True)  # 6 batches of 8
  expected = _generator(model, merge=False).translate_all(params, sentences, settings, **options)
  rows = []
  for chunk_rows in (live_chunks.CHUNK_ROWS, 2 * settings.beam_size):
    _chunks_of(monkeypatch, chunk_rows)
    generator = Generator(model, segment=SEGMENT)
    found = generator.translate_all(params, sentences, settings, **options)
    for (ids, scores, _), (want_ids, want_scores, _) in zip(_nested(found), _nested(expected)):
      assert ids == want_ids
      np.testing.assert_allclose(scores, want_scores, rtol=0, atol=1e-6)
    rows.append(generator.rows_searched)
  (whole, needed), (chunked, needed_too) = rows
  assert needed == needed_too and needed < chunked < whole


def test_a_first_piece_that_pauses_steps_every_row(tiny, monkeypatch):
  """Before its first pause a batch steps all its rows (few of its sentences are done by then,
  and a chunk's calls cost more than the rows it leaves out); the pieces after the pause, and a
  search in one piece, leave the finished sentences out (chunks of one sentence here)."""
  model, params = tiny
  settings, outputs = SETTINGS["gnmt-finished"]
  _chunks_of(monkeypatch, settings.beam_size)
  x = padded(SOURCES)
  begin, resume, _ = _pieces(model, settings, outputs)
  first, _ = begin(params, x, 8)
  assert int(first.state.t) == 8 and np.all(np.asarray(first.state.computed) == 8)
  assert np.any(np.asarray(first.state.searched) < 8)  # a sentence done before the pause
  later, _ = resume(params, first, 8, MAX_LEN)
  stepped = np.asarray(later.state.computed) - 8
  assert np.any(stepped < int(later.state.t) - 8)
  one, _ = begin(params, x, MAX_LEN)
  assert np.any(np.asarray(one.state.computed) < int(one.state.t))


def test_bfloat16_leaves_finished_sentences_out_too(tiny, monkeypatch):
  """bfloat16 steps chunks as float32 does, and finds the ids its whole-batch steps find."""
  model, params = tiny
  settings, outputs = SETTINGS["gnmt-finished"]
  typed = type(model)(dataclasses.replace(model.config, dtype="bfloat16"))
  found = []
  for rows in (2 * settings.beam_size, 3 * settings.beam_size):  # 8 sentences: chunks of 2, none
    _chunks_of(monkeypatch, rows)
    begin, _, _ = _pieces(typed, settings, outputs)  # traced anew: the chunk is chosen then
    piece, last = begin(params, padded(SOURCES), MAX_LEN)
    found.append((np.asarray(piece.state.computed), int(piece.state.t), _arrays(last)[0]))
  (chunked, t_chunked, ids_chunked), (whole, t_whole, ids_whole) = found
  assert np.any(chunked < t_chunked) and np.all(whole == t_whole)
  np.testing.assert_array_equal(ids_chunked, ids_whole)


def test_spare_entries_of_a_joined_piece_are_not_stepped(tiny, monkeypatch):
  """A joined piece's spare rows (`beam_pieces.spare`: copies of its last entry marked done) are
  left out of the steps over the sentences still searching: the real entry's search is the one it
  gets beside copies of itself that search, and the spare rows compute no step."""
  model, params = tiny
  settings, outputs = SETTINGS["gnmt-exact"]
  # A piece paused at the first segment end (stepped whole: its program is the one
  # test_chunks_give_the_whole_batchs_search_with_fewer_rows begins with), then chunks of one
  # sentence.
  _chunks_of(monkeypatch, 2 * settings.beam_size)
  begin, _, _ = _pieces(model, settings, outputs)
  first, _ = begin(params, padded(SOURCES), 4)
  _chunks_of(monkeypatch, settings.beam_size)
  _, resume, _ = _pieces(model, settings, outputs)
  host = jax.tree_util.tree_map(np.asarray, first)
  row = int(np.flatnonzero(~host.state.done)[0])  # a sentence still searching at the pause
  one = beam_pieces.entry(host, row)
  spares = beam_pieces.join([one] + [beam_pieces.spare(one)] * 3)
  copies = beam_pieces.join([one] * 4)
  found = []
  for piece in (spares, copies):
    piece, last = resume(params, piece, 4, MAX_LEN)
    found.append(([a[:1] for a in _arrays(last)], piece.state))
  (ours, state), (theirs, searching) = found
  _same_search(ours, theirs)
  assert int(state.searched[0]) == int(searching.searched[0])
  before = int(one.state.computed[0])
  assert np.all(np.asarray(state.computed[1:]) == before)  # the spare rows: no step
  assert np.all(np.asarray(searching.computed[1:]) > before)
