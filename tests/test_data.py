"""Tests of data/: sources, vocabularies, the token-id cache, batching and the pipeline."""

import gzip
import os
import pathlib
import stat
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

from configs.common import data_defaults
from data import batching, pipeline, sources, token_cache, tokenizer
from model.special_tokens import EOS_ID, PAD_ID, SEP_ID
from tests.helpers import REPO


def make_config(**data) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict({"seed": 0, "data": data_defaults()})
  config.data.update(data)
  return config


def small_synthetic(**data) -> ml_collections.ConfigDict:
  return make_config(
    synthetic_num_train=600, synthetic_num_eval=50, tokens_per_batch=512, max_len=32, **data
  )


def write(path: pathlib.Path, lines: list[str] | bytes) -> pathlib.Path:
  data = lines if isinstance(lines, bytes) else "".join(f"{s}\n" for s in lines).encode("utf-8")
  if path.suffix == ".gz":
    data = gzip.compress(data)
  path.write_bytes(data)
  return path


def fake_split(source_lengths, target_lengths) -> token_cache.TokenizedSplit:
  """Example i is `[i + 4] * (n - 1) + [EOS]` on each side, so a batch reveals which example it
  holds."""

  def side(lengths):
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.repeat(np.arange(len(lengths), dtype=np.int32) + 4, lengths)
    tokens[offsets[1:] - 1] = EOS_ID
    return tokens, offsets

  (st, so), (tt, to) = side(source_lengths), side(target_lengths)
  return token_cache.TokenizedSplit(st, so, tt, to, stats={}, path=pathlib.Path("fake"), built=True)


def segments(batch, prefix):
  """{(row, segment): example id} of one side of a batch, checking positions and EOS on the way."""
  found = {}
  tokens, seg, pos = (batch[prefix], batch[f"{prefix}_segmentation"], batch[f"{prefix}_position"])
  for r in range(tokens.shape[0]):
    assert np.all(tokens[r][seg[r] == 0] == PAD_ID) and np.all(pos[r][seg[r] == 0] == 0)
    for s in np.unique(seg[r][seg[r] > 0]):
      where = np.flatnonzero(seg[r] == s)
      assert np.array_equal(where, np.arange(where[0], where[0] + len(where)))  # contiguous
      assert np.array_equal(pos[r][where], np.arange(len(where)))  # restarts at 0
      assert tokens[r][where[-1]] == EOS_ID
      found[(r, int(s))] = int(tokens[r][where[0]]) - 4
  return found


def examples_in(batch):
  """Example ids in a batch; asserts source and target of each segment are the same example."""
  src, tgt = segments(batch, "inputs"), segments(batch, "targets")
  assert src == tgt
  return list(src.values())


# --------------------------------------------------------------------------------------------------
# sources


def test_files_plain_and_gz_strip_and_skip_empty(tmp_path):
  write(tmp_path / "train.en", ["  a b\t", "", "c\u00a0d ", "e", "   "])
  write(tmp_path / "train.de.gz", ["A B", "x", "C\u00a0D", " ", "y"])
  config = make_config(name="files", dir=str(tmp_path))
  pairs, stats = sources.load_split(config.data, "train")
  assert pairs == [("a b", "A B"), ("c\u00a0d", "C\u00a0D")]
  assert (stats.pairs, stats.skipped_empty) == (2, 3)


def test_files_missing_names_both_candidates(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"valid\.en.*valid\.en\.gz"):
    sources.split_file(tmp_path, "valid", "en")


def test_files_line_count_mismatch(tmp_path):
  src = write(tmp_path / "train.en", ["a", "b", "c"])
  tgt = write(tmp_path / "train.de.gz", ["a", "b"])
  with pytest.raises(ValueError, match=rf"{src}.* 3 lines.*{tgt}.* 2 lines"):
    sources.read_parallel_files(src, tgt)


def test_files_invalid_utf8_names_file_and_line(tmp_path):
  src = write(tmp_path / "train.en", b"ok\nfine\nbad \xff byte\n")
  tgt = write(tmp_path / "train.de", ["a", "b", "c"])
  with pytest.raises(ValueError, match=rf"{src}, line 3: invalid UTF-8"):
    list(sources.read_parallel_files(src, tgt))


def test_pipeline_rejects_misaligned_files_before_training(tmp_path):
  write(tmp_path / "train.en", ["a", "b", "c"])
  write(tmp_path / "train.de", ["x", "y"])
  workdir = tmp_path / "run"
  with pytest.raises(ValueError, match=r"train\.en has 3 lines.*train\.de has 2 lines"):
    pipeline.build(make_config(name="files", dir=str(tmp_path), vocab_size=50), workdir)
  assert not workdir.exists() or not any(workdir.rglob("*"))


@pytest.mark.parametrize(
  "source,target,reason",
  [
    ([], [], "are empty"),
    (["", "  "], [" ", ""], "every line pair has an empty side"),
    ("unreadable", ["a"], "cannot read: Permission denied"),
    ("corrupt gzip", ["a"], "cannot read: Error -3 while decompressing data"),
  ],
)
def test_training_files_that_hold_no_text_are_one_error_naming_them(
  tmp_path, monkeypatch, source, target, reason
):
  """An empty or blank corpus (SentencePiece's own error would name no file),
  an unreadable file (root reads any file, so open is made to refuse it) and a gzip file whose
  body is damaged: a ValueError naming the file, before a vocabulary or cache is written."""
  src = tmp_path / "train.en"
  write(tmp_path / "train.de", target)
  if source == "corrupt gzip":
    src = tmp_path / "train.en.gz"
    data = bytearray(gzip.compress(b"a sentence long enough to be compressed\n" * 50))
    data[20:30] = b"\xff" * 10  # the deflate stream, past the 10-byte header
    src.write_bytes(bytes(data))
  elif source == "unreadable":
    write(src, ["a"])
    real_open = open

    def refusing_open(path, *args, **kwargs):
      if pathlib.Path(path) == src:
        raise PermissionError(13, "Permission denied", str(path))
      return real_open(path, *args, **kwargs)

    monkeypatch.setattr(sources, "open", refusing_open, raising=False)
  else:
    write(src, source)
  workdir = tmp_path / "run"
  with pytest.raises(ValueError, match=reason) as raised:
    pipeline.build(make_config(name="files", dir=str(tmp_path), vocab_size=50), workdir)
  assert str(src) in str(raised.value) and "\n" not in str(raised.value)
  assert not workdir.exists() or not any(workdir.rglob("*"))


def test_vocabulary_and_cache_follow_the_umask(tmp_path):
  """Written under umask 022, the vocabulary (vocab.json, vocab.model) and the token-id cache
  are readable by the group and others (tempfile made them 0600 and 0700): a teammate can
  decode a shared workdir."""
  previous = os.umask(0o022)
  try:
    pipeline.build(small_synthetic(), tmp_path / "synthetic")
    texts = ["a b c d", "e f g h"] * 20
    tokenizer.train_sentencepiece(texts, 20, tmp_path / "spm" / "vocab.model")
  finally:
    os.umask(previous)
  paths = [tmp_path / "spm" / "vocab.model", *(tmp_path / "synthetic").rglob("*")]
  assert len(paths) > 10
  for path in paths:
    wanted = 0o755 if path.is_dir() else 0o644
    assert stat.S_IMODE(path.stat().st_mode) == wanted, path


def test_files_and_synthetic_do_not_import_tfds(tmp_path):
  code = (
    "import sys, ml_collections; from data import pipeline\n"
    "from configs.common import data_defaults\n"
    "config = ml_collections.ConfigDict({'seed': 0, 'data': data_defaults()})\n"
    "config.data.synthetic_num_train = 100\n"
    f"pipeline.build(config, {str(tmp_path)!r})\n"
    "assert 'tensorflow_datasets' not in sys.modules and 'tensorflow' not in sys.modules"
  )
  subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_synthetic_is_deterministic_and_reorders():
  kwargs = dict(num_examples=200, vocab=16, min_len=3, max_len=6, num_train=200)
  train = sources.synthetic_pairs("train", seed=1, **kwargs)
  assert train == sources.synthetic_pairs("train", seed=1, **kwargs)
  assert train != sources.synthetic_pairs("train", seed=2, **kwargs)
  mapping = {}
  for src, tgt in train:
    s, t = src.split(), tgt.split()
    assert 3 <= len(s) <= 6 and len(t) == len(s)
    for a, b in zip(reversed(s), t):  # target = reversed source, word by word renamed
      assert mapping.setdefault(a, b) == b
  assert any(a != b for a, b in mapping.items())  # words are renamed, not copied
  # Without reversing, no position-wise word mapping explains the targets.
  aligned = {}
  assert not all(
    aligned.setdefault(a, b) == b for src, tgt in train for a, b in zip(src.split(), tgt.split())
  )
  valid = {s for s, _ in sources.synthetic_pairs("validation", seed=1, **kwargs)}
  test = {s for s, _ in sources.synthetic_pairs("test", seed=1, **kwargs)}
  assert len(valid) == len(test) == 200  # distinct sentences
  assert not valid & {s for s, _ in train} and not test & {s for s, _ in train} and not valid & test


def test_tfds_under_mock_data_batches_within_budget(tmp_path):
  tfds = pytest.importorskip("tensorflow_datasets")
  config = make_config(
    name="wmt14_translate/de-en",
    vocab_size=100,
    tokens_per_batch=256,
    max_len=32,
    source_lang="de",
    target_lang="en",
  )
  with tfds.testing.mock_data(num_examples=40):
    pipe = pipeline.build(config, tmp_path)
    assert pipe.stats["train"]["examples"] + pipe.stats["train"]["filtered_long"] == 40
    source, target = pipe.pairs("test")[0]
    it = pipe.train_iter()
    for _ in range(3):
      batch = next(it)
      assert sorted(batch) == sorted(batching.FEATURES)
      rows, length = batch["targets"].shape
      assert rows * length <= config.data.tokens_per_batch
      for v in batch.values():
        assert v.dtype == np.int32 and v.shape == (rows, length)
    config.data.source_lang = "fr"
    with pytest.raises(ValueError, match=r"no language 'fr'.*\['de', 'en'\]"):
      sources.load_split(config.data, "train")
  assert isinstance(source, str) and isinstance(target, str)


def test_tfds_unknown_name():
  pytest.importorskip("tensorflow_datasets")
  with pytest.raises(ValueError, match="no_such_dataset_xyz"):
    sources.load_split(make_config(name="no_such_dataset_xyz").data, "train")


def test_real_multi30k(shared_data):
  config = make_config(
    name="files", dir=str(shared_data / "multi30k"), source_lang="en", target_lang="de"
  )
  pairs, stats = sources.load_split(config.data, "train")
  assert len(pairs) == 29000 and stats.skipped_empty == 0
  german = [t for _, t in pairs]
  assert all(t == t.strip() for t in german)  # 40 lines had trailing whitespace
  assert any("\u00a0" in t for t in german)  # no-break spaces inside are kept
  assert any("\t" in t for t in german)
  assert len(sources.load_split(config.data, "val")[0]) == 1014


def test_a_split_losing_over_one_percent_of_its_pairs_is_a_warning(tmp_path, caplog):
  """Examples dropped as too long (or cut, with data.truncate) are counted at INFO; when more than
  1% of a split goes, a WARNING names the split, the count, the share and the setting to change."""
  long = " ".join(f"w{i}" for i in range(40))
  train = [f"w{i} w{i + 1}" for i in range(90)] + [long] * 10  # 10% too long for max_len 16
  val = [f"w{i} w{i + 2}" for i in range(200)] + [long]  # 0.5%: no warning
  for split, lines in (("train", train), ("val", val)):
    for lang in ("en", "de"):
      write(tmp_path / f"{split}.{lang}", lines)
  config = make_config(
    name="files",
    dir=str(tmp_path),
    eval_split="val",
    vocab_size=60,
    max_len=16,
    tokens_per_batch=64,
  )
  import logging

  with caplog.at_level(logging.INFO):
    pipeline.build(config, tmp_path / "work")
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  dropped = [w for w in warnings if "dropped as longer than data.max_len=16" in w]
  assert len(dropped) == 1 and "files/train: 10 of 100 pairs (10.0%)" in dropped[0], warnings
  assert "data.truncate=True" in dropped[0]
  caplog.clear()
  config.data.update(truncate=True)
  with caplog.at_level(logging.INFO):
    pipeline.build(config, tmp_path / "work2")
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert any(
    "files/train: 10 of 100 pairs (10.0%) were cut to data.max_len=16" in w for w in warnings
  )


# --------------------------------------------------------------------------------------------------
# vocabularies


def test_sentencepiece_sep_id_round_trip_and_reuse(tmp_path):
  words = "the a cat dog sat on mat ran to house big small red green".split()
  rng = np.random.default_rng(0)
  texts = [" ".join(rng.choice(words, 6)) for _ in range(1000)]
  path = tmp_path / "vocab.model"
  vocab = tokenizer.train_sentencepiece(texts, 120, path)
  assert path.is_file() and not list(tmp_path.glob("*.tmp"))
  assert SEP_ID in vocab.encode("cat <sep> dog") and vocab.vocab_size <= 120
  ids = vocab.encode(texts[0])
  assert EOS_ID not in ids and vocab.decode(ids) == texts[0]
  assert vocab.decode(ids + [EOS_ID, 7, 8]) == texts[0]  # stops at EOS
  assert vocab.decode([PAD_ID] + ids + [PAD_ID]) == texts[0]
  # An id past the vocabulary (a model with a larger model.vocab_size) reads as <unk>.
  assert vocab.decode(ids + [vocab.vocab_size + 3]).startswith(texts[0])
  again = tokenizer.load_vocab(path)
  assert again.fingerprint == vocab.fingerprint and again.encode(texts[1]) == vocab.encode(texts[1])

  def never():
    raise AssertionError("must reuse <workdir>/vocab.model")

  config = make_config(name="files", vocab_size=120)
  assert (
    tokenizer.load_or_train_vocab(config.data, tmp_path, never).fingerprint == vocab.fingerprint
  )
  # A smaller size in the config is not silently given the workdir's bigger vocabulary.
  with pytest.raises(
    ValueError,
    match=rf"vocab.model has {vocab.vocab_size} pieces, more than "
    r"data.vocab_size=20",
  ):
    tokenizer.load_or_train_vocab(make_config(name="files", vocab_size=20).data, tmp_path, never)


def test_synthetic_vocabulary_of_another_size_is_refused(tmp_path):
  pipeline.build(small_synthetic(synthetic_vocab=8), tmp_path)
  assert pipeline.build(small_synthetic(synthetic_vocab=8), tmp_path).vocab.vocab_size == 12
  with pytest.raises(
    ValueError,
    match=r"vocab.json holds another synthetic vocabulary \(12 ids\) "
    r"than data.synthetic_vocab=16 makes",
  ):
    pipeline.build(small_synthetic(synthetic_vocab=16), tmp_path)


def test_sentencepiece_training_keeps_the_text_error(tmp_path):
  def texts():
    yield "one line"
    raise ValueError("x.en, line 2: invalid UTF-8")

  with pytest.raises(ValueError, match="line 2"):
    tokenizer.train_sentencepiece(texts(), 50, tmp_path / "vocab.model")
  assert not list(tmp_path.iterdir())


def test_word_vocab_json_and_load_errors(tmp_path):
  vocab = tokenizer.WordVocab(["w0", "w1", "w2"])
  assert vocab.vocab_size == 7 and vocab.encode("w2 w0 zz") == [6, 4, tokenizer.UNK_ID]
  assert vocab.decode_batch(np.array([[6, 4, EOS_ID, 5], [5, PAD_ID, PAD_ID, PAD_ID]])) == [
    "w2 w0",
    "w1",
  ]
  vocab.save(tmp_path / "vocab.json")
  again = tokenizer.load_vocab(tmp_path / "vocab.json")
  assert again.fingerprint == vocab.fingerprint and again.words == vocab.words
  with pytest.raises(FileNotFoundError, match="missing.model"):
    tokenizer.load_vocab(tmp_path / "missing.model")
  (tmp_path / "bad.json").write_text("[1, 2]")
  with pytest.raises(ValueError, match="bad.json"):
    tokenizer.load_vocab(tmp_path / "bad.json")
  (tmp_path / "bad.model").write_bytes(b"not a model")
  with pytest.raises(ValueError, match="bad.model"):
    tokenizer.load_vocab(tmp_path / "bad.model")


# --------------------------------------------------------------------------------------------------
# token-id cache


def test_cache_is_reused_and_keyed_by_vocab(tmp_path):
  pairs = [("w0 w1", "w1"), ("w2 " * 9, "w0"), ("w1", "w2 w2")]
  calls = []

  def pairs_fn(stats):
    calls.append(1)
    return sources._clean(pairs, stats)

  vocab = tokenizer.WordVocab(["w0", "w1", "w2"])
  args = dict(max_len=5, truncate=False)
  first = token_cache.load_or_tokenize(tmp_path, "train", {"c": 1}, vocab, pairs_fn, **args)
  assert first.built and first.stats["examples"] == 2 and first.stats["filtered_long"] == 1
  assert np.array_equal(first.source_tokens[: first.source_offsets[1]], [4, 5, EOS_ID])
  second = token_cache.load_or_tokenize(tmp_path, "train", {"c": 1}, vocab, pairs_fn, **args)
  assert not second.built and len(calls) == 1 and second.path == first.path
  assert np.array_equal(second.target_tokens, first.target_tokens)
  other = token_cache.load_or_tokenize(
    tmp_path, "train", {"c": 1}, tokenizer.WordVocab(["w1", "w0", "w2"]), pairs_fn, **args
  )
  assert other.built and other.path != first.path and len(calls) == 2
  cut = token_cache.load_or_tokenize(
    tmp_path, "train", {"c": 1}, vocab, pairs_fn, max_len=5, truncate=True
  )
  assert cut.stats["truncated_long"] == 1 and cut.num_examples == 3
  assert cut.source_lengths.max() == 5 and cut.source_tokens[cut.source_offsets[2] - 1] == EOS_ID
  assert not list(tmp_path.glob(".*"))  # no temporary folders left


def test_cache_of_a_split_name_with_a_slash(tmp_path):
  vocab = tokenizer.WordVocab(["w0", "w1"])
  split = token_cache.load_or_tokenize(
    tmp_path,
    "dev/news 2013",
    {},
    vocab,
    lambda stats: sources._clean([("w0", "w1")], stats),
    max_len=8,
  )
  assert split.num_examples == 1 and split.path.parent == tmp_path
  assert split.path.name.startswith("dev_news_2013-")


def test_files_without_data_dir_is_a_config_error(tmp_path):
  with pytest.raises(ValueError, match="data.name='files' needs data.dir"):
    sources.corpus_identity(make_config(name="files", dir="").data, "train")


def test_cache_leaves_nothing_on_error(tmp_path):
  def broken(stats):
    yield "w0", "w1"
    raise ValueError("boom")

  with pytest.raises(ValueError, match="boom"):
    token_cache.load_or_tokenize(
      tmp_path, "train", {}, tokenizer.WordVocab(["w0", "w1"]), broken, max_len=8
    )
  assert not list(tmp_path.iterdir())


def test_pipeline_second_build_reads_the_cache(tmp_path):
  config = small_synthetic()
  first = pipeline.build(config, tmp_path)
  assert first.batcher("train").data.built and (tmp_path / "vocab.json").is_file()
  second = pipeline.build(config, tmp_path)
  assert not second.batcher("train").data.built and second.stats == first.stats
  assert len(list((tmp_path / "cache").iterdir())) == 2  # train and validation


# --------------------------------------------------------------------------------------------------
# batching

LENGTHS = np.random.default_rng(3).integers(2, 21, size=(2, 300))


def test_packing_segments_positions_and_every_example_once():
  data = fake_split(*LENGTHS)
  batcher = batching.Batcher(data, tokens_per_batch=400, max_len=20, packing=True, batch_multiple=4)
  assert batcher.batch_shapes == [(20, 20)]
  for epoch in (0, 1):
    seen = []
    for plan in batcher.epoch_plan(epoch):
      batch = batcher.materialize(plan)
      assert batch["inputs"].shape == (20, 20)
      seen += examples_in(batch)
    assert sorted(seen) == list(range(300))
  assert np.any(batcher.materialize(batcher.epoch_plan(0)[0])["targets_segmentation"] > 1)  # packs
  orders = [np.concatenate([p.examples for p in batcher.epoch_plan(e)]) for e in (0, 1)]
  assert not np.array_equal(*orders)  # reshuffled each epoch


def test_bucketing_shapes_within_budget():
  data = fake_split(*LENGTHS)
  batcher = batching.Batcher(
    data, tokens_per_batch=256, max_len=20, packing=False, batch_multiple=2
  )
  assert batcher.batch_shapes == [(32, 8), (16, 16), (12, 20)]
  seen = []
  for plan in batcher.epoch_plan(0):
    batch = batcher.materialize(plan)
    assert batch["targets"].shape in batcher.batch_shapes
    assert batch["targets"].size <= 256 and np.all(batch["targets_segmentation"] <= 1)
    seen += examples_in(batch)
  assert sorted(seen) == list(range(300))


@pytest.mark.parametrize("packing", [True, False])
def test_eval_batches_cover_every_example_once(packing):
  data = fake_split(*LENGTHS[:, :295])  # the last batch is not full
  batcher = batching.Batcher(
    data, tokens_per_batch=400, max_len=20, packing=packing, process_count=2, process_index=1
  )
  batches = [
    batching.Batcher(
      data, tokens_per_batch=400, max_len=20, packing=packing, process_count=2, process_index=0
    ).eval_batches(),
    batcher.eval_batches(),
  ]
  seen = []
  for pair in zip(*batches):
    assert pair[0]["inputs"].shape == pair[1]["inputs"].shape == (10, 20)
    seen += examples_in(pair[0]) + examples_in(pair[1])
  assert sorted(seen) == list(range(295))
  assert np.all(pair[1]["targets_segmentation"][-1] == 0)  # last batch ends with padding rows


def test_processes_get_disjoint_slices_of_the_global_batch():
  data = fake_split(*LENGTHS)
  for packing in (True, False):
    args = dict(tokens_per_batch=300, max_len=20, packing=packing, batch_multiple=2, seed=5)
    whole = batching.Batcher(data, **args).train_iter()
    parts = [
      batching.Batcher(data, process_index=p, process_count=2, **args).train_iter() for p in (0, 1)
    ]
    for _ in range(12):
      global_batch, p0, p1 = next(whole), next(parts[0]), next(parts[1])
      assert p0["inputs"].shape == p1["inputs"].shape
      for key in batching.FEATURES:
        assert np.array_equal(np.concatenate([p0[key], p1[key]]), global_batch[key])
      assert not set(examples_in(p0)) & set(examples_in(p1))


def test_resume_yields_the_same_next_batches(tmp_path):
  config = small_synthetic(packing=False)
  it = pipeline.build(config, tmp_path).train_iter()
  for _ in range(40):  # past the end of the first epoch
    next(it)
  state = it.state()
  assert state["epoch"] >= 1
  expected = [next(it) for _ in range(5)]
  restored = pipeline.build(config, tmp_path).train_iter()
  restored.restore(state)
  for want in expected:
    got = next(restored)
    for key in batching.FEATURES:
      assert np.array_equal(got[key], want[key])
  with pytest.raises(ValueError, match="bad data iterator state"):
    restored.restore({"epoch": 1})


def test_resume_with_another_batch_plan_continues_the_epoch_at_the_same_fraction(caplog):
  """Another device count changes the rows per batch, so the saved batch index names other
  examples; the restored iterator warns with what changed and continues where the checkpoint
  was in the epoch: over the epoch, at most one batch's worth of examples is repeated or missed."""
  import logging

  data = fake_split(*LENGTHS)
  args = dict(tokens_per_batch=300, max_len=20, packing=True, seed=5)
  old = batching.Batcher(data, batch_multiple=1, **args).train_iter()
  seen = [e for _ in range(7) for e in examples_in(next(old))]
  state = old.state()
  assert state["epoch"] == 0 and state["index"] == 7 and state["plan"]["row_multiple"] == 1
  new = batching.Batcher(data, batch_multiple=4, **args).train_iter()
  with caplog.at_level(logging.WARNING):
    new.restore(state)
  assert "batch plan changed since the checkpoint (row_multiple: 1 -> 4)" in caplog.text
  total = len(new._batcher.epoch_plan(0))
  assert total != state["batches"]
  assert new.state()["index"] == round(7 * total / state["batches"])
  while new.epoch == 0:
    batch = next(new)
    if new.epoch == 0:
      seen += examples_in(batch)
  rows = 12  # rows per batch with the multiple of 4; at most 3 examples fit a 20-token row
  assert abs(len(seen) - 300) <= rows * 3 and len(set(seen)) >= 300 - rows * 3
  caplog.clear()
  same = batching.Batcher(data, batch_multiple=1, **args).train_iter()
  with caplog.at_level(logging.WARNING):
    same.restore(state)
  assert same.state()["index"] == 7 and "batch plan changed" not in caplog.text


def test_throughput_counts_the_batches_and_tokens_it_pulled():
  """data/throughput.py's measure: the batches and non-padding tokens of the packed batches it
  pulled, over the same elapsed time (how fast is bench.py's and `python -m cli.throughput`'s
  business, not a test's)."""
  from data.throughput import measure_throughput

  rng = np.random.default_rng(0)
  data = fake_split(rng.integers(2, 40, 2000), rng.integers(2, 40, 2000))
  batcher = batching.Batcher(data, tokens_per_batch=8192, max_len=64, packing=True)
  pulled = []

  def recorded(batches):
    for batch in batches:
      pulled.append(batch)
      yield batch

  result = measure_throughput(recorded(batcher.train_iter()), seconds=0.2)
  assert result["batches"] == len(pulled) >= 1
  count = {
    side: sum(int(np.count_nonzero(b[f"{side}_segmentation"])) for b in pulled)
    for side in ("inputs", "targets")
  }
  elapsed = result["batches"] / result["batches_per_s"]
  assert result["target_tokens_per_s"] * elapsed == pytest.approx(count["targets"])
  assert result["tokens_per_s"] * elapsed == pytest.approx(count["inputs"] + count["targets"])
  for batch in pulled:  # whole examples, source and target together
    examples_in(batch)
