"""Imported Marian / OPUS-MT models translate as Marian does: tiny releases with random weights
(tests/marian_model.py) imported by formats/marian.py and decoded here, against Marian itself
(pymarian, run in a subprocess: it aborts the process on an error). Then what the importer
refuses, before writing anything.

Each variant's sentences are the first SENTENCES of the generated ones whose Marian greedy
translation ends by itself and is not empty (random weights make some degenerate); the checks
then hold for every one of them, with beam 1 and beam 4, normalisation off and on.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from formats import marian, marian_files
from inference.translator import Translator
from model import distribution
from model.config import TransformerConfig
from model.special_tokens import EOS_ID
from model.transformer import Transformer
from tests import marian_model
from tests.helpers import Compilations
from tests.marian_model import Variant

SENTENCES = 50
WIDTH = 64  # forced decoding's padded width: every source and greedy output fits
CANDIDATES = 400
RUNS = ({"beam": 1, "normalize": 0}, {"beam": 4, "normalize": 0}, {"beam": 4, "normalize": 1})
# (variant, seed): weights whose outputs are a few tokens long (tests/marian_model.py).
VARIANTS = {
  "swish-tied": (Variant(eos_after=1.0, context_scale=3, logit_scale=3), 40),
  "relu-untied-padded": (
    Variant(
      activation="relu",
      tied="none",
      pad_config=True,
      eos_after=1.0,
      context_scale=2,
      logit_scale=2,
      emb_scale=2,
    ),
    9,
  ),
  "relu-tied-prenorm": (
    Variant(
      activation="relu",
      pre_norm=True,
      eos_after=1.6,
      eos_bias=-1,
      context_scale=2,
      sublayer_scale=3,
      logit_scale=2,
      emb_scale=0.5,
    ),
    65,
  ),
}
RUN_MARIAN = pathlib.Path(__file__).with_name("marian_run.py")


def run_marian(folder: pathlib.Path, lines: list[str], runs) -> list[list[str]]:
  job = folder / "job.json"
  spec = {"model": str(folder / "model.npz"), "vocab": str(folder / "vocab.yml")}
  job.write_text(json.dumps({**spec, "lines": lines, "runs": list(runs)}), encoding="utf-8")
  done = subprocess.run(
    [sys.executable, str(RUN_MARIAN), str(job)], capture_output=True, text=True, timeout=300
  )
  assert done.returncode == 0, done.stderr[-2000:]
  return json.loads(done.stdout)


def text_of(pieces: str) -> str:
  """Marian's output pieces as text, as OPUS-MT's postprocess.sh makes it."""
  return pieces.replace(" ", "").replace("\u2581", " ").strip()


class Case:
  """One variant: the release, Marian's outputs, the imported workdir and its Translator."""

  def __init__(self, root: pathlib.Path, name: str):
    variant, seed = VARIANTS[name]
    self.folder = root / name
    marian_model.write_release(self.folder, variant, seed)
    release = marian_files.read_release(self.folder)
    self.imported = marian.convert(release)
    marian.write_workdir(self.imported, root / f"{name}-workdir")
    self.translator = Translator.load(root / f"{name}-workdir", dtype="float32")
    source = self.imported.vocab._sp[0]
    texts = marian_model.sentences(CANDIDATES, 1234)
    lines = [" ".join(source.encode(t, out_type=str)) for t in texts]
    (greedy,) = run_marian(self.folder, lines, RUNS[:1])
    limits = [3 * (len(x.split()) + 1) for x in lines]
    keep = [i for i, (o, n) in enumerate(zip(greedy, limits)) if 0 < len(o.split()) < n][:SENTENCES]
    assert len(keep) == SENTENCES, f"{name}: {len(keep)} usable sentences of {CANDIDATES}"
    self.texts = [texts[i] for i in keep]
    self.lines = [lines[i] for i in keep]
    self.limits = [limits[i] for i in keep]
    self.marian = run_marian(self.folder, self.lines, [*RUNS, {**RUNS[0], "word_scores": True}])


def need_pymarian() -> None:
  """Skips a comparison with Marian where pymarian is not installed (`pip install -e
  '.[marian]'`); under CI (`CI` set, as .ci/run runs), where it is installed, fails instead."""
  if importlib.util.find_spec("pymarian") is None:
    if os.environ.get("CI"):
      pytest.fail("pymarian is not installed: .ci/run installs the 'marian' extra")
    pytest.skip("Marian itself is needed: pip install -e '.[marian]'")


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def case(request, tmp_path_factory):
  need_pymarian()
  return Case(tmp_path_factory.mktemp("marian"), request.param)


def test_marian_position_table_and_default_search(case):
  """Marian's table (src/tensors/cpu/tensor_operators.cpp SinusoidalPositionEmbeddings: sin of
  the first d/2 channels, cos of the rest, frequency exp(-i ln(1e4) / (d/2 - 1))), and an
  imported workdir searching as Marian unless told otherwise."""
  from model.layers import position_encoding

  cfg = TransformerConfig(**{k: v for k, v in case.imported.model_options.items() if k != "type"})
  d, half = cfg.d_model, cfg.d_model // 2
  pos = np.arange(40, dtype=np.float32)[:, None]
  angle = pos * np.exp(np.arange(d) % half * -np.float32(np.log(10000.0) / (half - 1)))
  marians = np.where(np.arange(d) < half, np.sin(angle), np.cos(angle))
  ours = np.asarray(position_encoding(jnp.arange(40)[None], cfg)[0])
  np.testing.assert_allclose(ours, marians, atol=2e-5)
  assert case.translator.settings().length_penalty == "marian"


def test_translations_equal_marians(case):
  """Our translations are Marian's, greedy and beam 4 with normalisation off and on; the beam
  searches share one program (`normalize` is an argument of the search, as alpha is)."""
  compiled = []
  for run, theirs in zip(RUNS, case.marian):
    with Compilations(None) as compiling:
      ours = case.translator.translate(
        case.texts, beam_size=run["beam"], alpha=float(run["normalize"]), length_penalty="marian"
      )
    compiled.append(compiling.count)
    assert ours == [text_of(x) for x in theirs], run
    lengths = [len(x.split()) for x in theirs]
    # A few tokens each, ended by themselves (below the length limit), and not all alike: the
    # greedy ones all (the sentences are chosen so), most of the normalised beam search's (beam
    # search without normalisation prefers the empty translation of many).
    if run["beam"] == 1 or run["normalize"]:
      ended = sum(0 < n < limit for n, limit in zip(lengths, case.limits))
      assert ended >= (SENTENCES if run["beam"] == 1 else 0.8 * SENTENCES), run
      assert len(set(theirs)) >= SENTENCES // 5, run
  assert compiled[1] > 0 and compiled[2] == 0, compiled  # normalize 1 reads normalize 0's program


def test_token_log_probabilities_equal_marians(case):
  """Marian's per-token log-probabilities of its greedy translations (`</s>` included) are those
  of our search, within 1e-4; and, post-norm, those of forced decoding (teacher-forced) of the
  same tokens (Marian's pre-norm decoder attends otherwise step by step: `raw_self_keys`)."""
  vocab = case.imported.vocab
  options = dict(case.imported.model_options, dropout_rate=0.0)
  options.pop("type")
  model = Transformer(TransformerConfig(**options))
  params = case.imported.params

  @jax.jit
  def forced(x, y):
    return distribution.log_probs(distribution.mask(model.apply({"params": params}, x, y)))

  run = case.translator.run(
    case.texts, beam_size=1, alpha=0.0, length_penalty="marian", return_token_scores=True
  )
  for i, (text, line) in enumerate(zip(case.texts, case.marian[3])):
    _, pieces, word_scores = line.split(" ||| ")[:3]
    theirs = [float(x) for x in word_scores.split("=")[1].split()]
    np.testing.assert_allclose(run.token_scores[i][0], theirs, atol=1e-4)
    if options["pre_ln"]:
      continue
    target = [vocab._ids[p] for p in pieces.split()] + [EOS_ID]
    source = vocab.encode(text) + [EOS_ID]
    # One shape for every sentence (one compilation): PAD after each.
    padded = [np.pad(x, (0, WIDTH - len(x))) for x in (source, target)]
    logp = forced(*(jnp.array([x]) for x in padded))[0]
    ours = np.asarray(logp)[np.arange(len(target)), target]
    np.testing.assert_allclose(ours, theirs, atol=1e-4)


# --- refusals ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> pathlib.Path:
  folder = tmp_path_factory.mktemp("release")
  marian_model.write_release(folder, Variant(pad_config=True), 0)
  return folder


def copy(release: pathlib.Path, dest: pathlib.Path) -> pathlib.Path:
  dest.mkdir()
  for p in release.iterdir():
    (dest / p.name).write_bytes(p.read_bytes())
  return dest


def refused(folder, workdir, match: str):
  with pytest.raises(marian_files.MarianError, match=match) as raised:
    marian.write_workdir(marian.convert(marian_files.read_release(folder)), workdir)
  assert "\n" not in str(raised.value)
  assert not pathlib.Path(workdir).exists()
  return raised


def set_option(folder: pathlib.Path, key: str, value) -> None:
  with np.load(folder / "model.npz") as npz:
    arrays = dict(npz)
  config = marian_files.model_config(arrays, "model.npz")
  if value is None:
    config.pop(key)
  else:
    config[key] = value
  arrays[marian.MODEL_YML] = marian_model.config_array(config, pad=True)
  np.savez(folder / "model.npz", **arrays)


def test_imports_a_padded_config_and_a_zip(release, tmp_path):
  folder = marian.convert(marian_files.read_release(release))
  with zipfile.ZipFile(tmp_path / "r.zip", "w") as zf:
    for p in release.iterdir():
      zf.write(p, f"opus-mt/{p.name}")
  zipped = marian.convert(marian_files.read_release(tmp_path / "r.zip"))
  assert zipped.model_options == folder.model_options
  assert zipped.vocab.fingerprint == folder.vocab.fingerprint
  # The yml's quoted and escaped pieces read back as the SentencePiece models' pieces.
  pieces = set(folder.vocab.pieces)
  assert {"\u2581", '"', "\\", ":", "#", "'"} <= pieces


def test_decoder_yml_gives_the_default_beam_and_normalisation(release, tmp_path):
  folder = copy(release, tmp_path / "r")
  options = yaml.safe_load((folder / "decoder.yml").read_text())
  (folder / "decoder.yml").write_text(yaml.safe_dump({**options, "beam-size": 6, "normalize": 0.6}))
  imported = marian.convert(marian_files.read_release(folder))
  assert imported.search == {"beam_size": 6, "alpha": 0.6}
  assert marian.decoder_search({"normalize": True}) == {"alpha": 1.0}  # a bare flag: 1
  workdir = marian.write_workdir(imported, tmp_path / "w")
  settings = Translator.load(workdir).settings()
  assert (settings.beam_size, settings.alpha, settings.length_penalty) == (6, 0.6, "marian")
  assert Translator.load(workdir).settings(beam_size=2).beam_size == 2  # asked for: as asked
  for key, value, match in (
    ("beam-size", 0, "decoder.yml: beam-size=0: expected a positive integer"),
    ("normalize", "x", "decoder.yml: normalize='x': expected a number >= 0"),
  ):
    (folder / "decoder.yml").write_text(yaml.safe_dump({**options, key: value}))
    refused(folder, tmp_path / f"w{key}", re.escape(match))


@pytest.mark.parametrize(
  "key, value, match",
  [
    ("type", "s2s", "option type='s2s' is not supported"),
    ("transformer-ffn-activation", "tanh", "transformer-ffn-activation='tanh'"),
    ("transformer-decoder-autoreg", "rnn", "transformer-decoder-autoreg='rnn'"),
    ("transformer-postprocess", "dhn", "transformer-postprocess='dhn'"),
    ("dec-depth", 3, "dec-depth=3"),
    ("enc-depth", None, "option enc-depth is missing"),
  ],
)
def test_refuses_unsupported_options(release, tmp_path, key, value, match):
  folder = copy(release, tmp_path / "r")
  set_option(folder, key, value)
  refused(folder, tmp_path / "w", match)


def test_refuses_missing_files_and_mismatched_vocabularies(release, tmp_path):
  folder = copy(release, tmp_path / "r")
  (folder / "target.spm").unlink()
  refused(folder, tmp_path / "w", "the release has no target.spm")
  folder = copy(release, tmp_path / "r2")
  lines = (folder / "vocab.yml").read_text(encoding="utf-8").splitlines()
  (folder / "vocab.yml").write_text("\n".join(lines[:-1]) + "\n", encoding="utf-8")
  refused(folder, tmp_path / "w", "pieces, but the model's embeddings have")
  refused(tmp_path / "nothing", tmp_path / "w", "no such folder or zip file")


def test_refuses_unreadable_and_tampered_files(release, tmp_path):
  folder = copy(release, tmp_path / "r")
  (folder / "model.npz").write_bytes(b"not an npz")
  refused(folder, tmp_path / "w", "model.npz: not a readable npz file")
  # An object array would need pickle: refused, never unpickled (it would run code).
  folder = copy(release, tmp_path / "r2")
  with np.load(folder / "model.npz") as npz:
    arrays = dict(npz)
  arrays["Wemb"] = np.array([{"a": 1}], dtype=object)
  np.savez(folder / "model.npz", **arrays)
  refused(folder, tmp_path / "w", "model.npz: not a readable npz file.*allow_pickle")
  # yml is read safely: a Python tag is an error, not an object.
  folder = copy(release, tmp_path / "r3")
  (folder / "decoder.yml").write_text("models: !!python/object/apply:os.system ['true']\n")
  refused(folder, tmp_path / "w", "decoder.yml: not readable YAML")
  folder = copy(release, tmp_path / "r4")
  (folder / "decoder.yml").write_text(
    yaml.safe_dump({"models": ["../model.npz"], "vocabs": ["vocab.yml"] * 2})
  )
  refused(folder, tmp_path / "w", "must name a file of the release")


@pytest.mark.parametrize("member", ["../evil.txt", "/abs/evil.txt", "a/../../evil.txt"])
def test_refuses_a_zip_member_outside_its_folder(release, tmp_path, member):
  with zipfile.ZipFile(tmp_path / "r.zip", "w") as zf:
    for p in release.iterdir():
      zf.write(p, p.name)
    zf.writestr(member, b"x")
  refused(tmp_path / "r.zip", tmp_path / "w", "would leave the release's folder")
  assert not (tmp_path.parent / "evil.txt").exists()


def test_refuses_a_link_in_a_zip(release, tmp_path):
  with zipfile.ZipFile(tmp_path / "r.zip", "w") as zf:
    for p in release.iterdir():
      zf.write(p, p.name)
    link = zipfile.ZipInfo("source.spm.link")
    link.external_attr = 0o120777 << 16
    zf.writestr(link, "/etc/passwd")
  refused(tmp_path / "r.zip", tmp_path / "w", "is a link")


def test_refuses_a_non_empty_workdir(release, tmp_path):
  (tmp_path / "w").mkdir()
  (tmp_path / "w" / "x").write_text("x")
  with pytest.raises(marian_files.MarianError, match="exists and is not an empty folder"):
    marian.write_workdir(marian.convert(marian_files.read_release(release)), tmp_path / "w")


# --- CTranslate2 ------------------------------------------------------------------------------


def test_ctranslate2_converter_translates_as_an_import_following_it(tmp_path):
  """CTranslate2's OpusMTConverter is not Marian-exact (its position table and LayerNorm
  epsilon); imported with `follow='ctranslate2'` and decoded with our CTranslate2-equal search
  (fairseq length penalty), the model translates as its conversion does."""
  ctranslate2 = pytest.importorskip("ctranslate2")
  from ctranslate2.converters import OpusMTConverter

  from inference.ctranslate2_translate import translate_tokens

  variant, seed = VARIANTS["swish-tied"]  # CTranslate2 reads only an unpadded config
  marian_model.write_release(tmp_path / "release", variant, seed)
  OpusMTConverter(str(tmp_path / "release")).convert(str(tmp_path / "ct2"))
  imported = marian.convert(marian_files.read_release(tmp_path / "release"), follow="ctranslate2")
  marian.write_workdir(imported, tmp_path / "workdir")
  ours = Translator.load(tmp_path / "workdir", dtype="float32")
  theirs = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu", intra_threads=1)
  texts = marian_model.sentences(SENTENCES, 1234)
  tokens = [imported.vocab._sp[0].encode(t, out_type=str) for t in texts]
  for beam in (1, 4):
    found = translate_tokens(theirs, tokens, max_extra_len=50, beam_size=beam, length_penalty=1.0)
    expected = [text_of(" ".join(t)) for t in found]
    got = ours.translate(texts, beam_size=beam, alpha=1.0, length_penalty="fairseq")
    assert got == expected, beam
    assert len(set(got)) >= SENTENCES // 5


def test_our_ctranslate2_export_of_an_import_translates_as_we_do(case, tmp_path):
  """inference/ctranslate2_export.py writes an imported model's options explicitly (position
  table, LayerNorm epsilon, activation, zero first input, biases): the export translates as our
  CTranslate2-equal search does; Marian's pre-norm decoding (raw_self_keys) is refused."""
  ctranslate2 = pytest.importorskip("ctranslate2")
  from core.errors import UsageError
  from inference.ctranslate2_export import export
  from inference.ctranslate2_translate import Pieces, translate_texts

  workdir = case.folder.parent / f"{case.folder.name}-workdir"
  if case.imported.model_options["raw_self_keys"]:
    with pytest.raises(UsageError, match="raw_self_keys"):
      export(workdir, tmp_path / "ct2")
    return
  path = export(workdir, tmp_path / "ct2")
  theirs = ctranslate2.Translator(str(path), device="cpu", intra_threads=1)
  pieces = Pieces(case.imported.vocab)
  for beam in (1, 4):
    expected = case.translator.translate(
      case.texts, beam_size=beam, alpha=1.0, length_penalty="fairseq"
    )
    got = translate_texts(theirs, pieces, case.texts, beam_size=beam, length_penalty=1.0)
    assert got == expected, beam
