"""inference/ctranslate2_export.py and bench.py's CTranslate2 peer: the exported model translates
exactly as ours does (greedy, and beam search without a length penalty), token for token, with our
length limit; every weight is mapped (post- and pre-LN, tied and separate embeddings); what cannot
be exported, and bad command lines, are one-line errors; the benchmark's peer decodes our
benchmark model's own weights to exactly bench.decode_len tokens."""

import dataclasses
import json
import pathlib
from typing import Any, NamedTuple

import jax
import numpy as np
import pytest
from absl import flags

from benchmark import ctranslate2 as peer
from benchmark import decoding, paired, records, report
from benchmark.options import Options
from configs import tiny
from core.cpu import usable_cores
from core.errors import UsageError
from data.sources import synthetic_pairs
from inference import ctranslate2_export as ce
from inference import ctranslate2_translate as ct
from inference.generator import Generator, translate_all
from inference.restore import load_for_inference
from model.build import build_model
from model.quantize import Int8Matrix
from model.search_settings import SearchSettings
from model.special_tokens import EOS_ID
from tests.helpers import random_params, run_in_process, run_py, tiny_config
from training.validate import check_config

ctranslate2 = pytest.importorskip(
  "ctranslate2",
  reason="CTranslate2 is optional: pip install 'attention-jax[ctranslate2]' (CI installs it)",
)

PROG = "cli.ctranslate2_export"


class Exported(NamedTuple):
  """The tiny trained run (`workdir`, `restored`, its `model`) and its float32 export (`out`),
  loaded (`translator`); `generator`: our searches of the model, one `Generator` for the module
  (each distinct search is compiled once, and settings differing only in alpha share one)."""

  workdir: pathlib.Path
  restored: Any
  model: Any
  out: pathlib.Path
  translator: Any
  generator: Any


@pytest.fixture(scope="module")
def exported(uninterrupted, tmp_path_factory):
  _, workdir = uninterrupted
  out = ce.export(workdir, tmp_path_factory.mktemp("ct2") / "model")
  restored = load_for_inference(workdir)
  translator = ctranslate2.Translator(str(out), device="cpu", compute_type="float32")
  model = build_model(restored.config.model)
  generator = Generator(model, num_ids=restored.vocab.vocab_size)
  return Exported(workdir, restored, model, out, translator, generator)


def _sentences(restored, n=300):
  """`n` synthetic-task source sentences of 1..12 words (the model was trained on 4..6)."""
  data = restored.config.data
  pairs = synthetic_pairs(
    "test", num_examples=n, vocab=data.synthetic_vocab, min_len=1, max_len=12, num_train=2000
  )
  return [source for source, _ in pairs]


def _ours(exported, texts, prefixes=None, **settings):
  """Our translations of `texts` (ids), searched as `settings` (SearchSettings' fields) say, by
  the module's `Generator`."""
  restored = exported.restored
  ids = [restored.vocab.encode(t) + [EOS_ID] for t in texts]
  found = exported.generator.translate_all(
    restored.params, ids, SearchSettings(**settings), prefixes=prefixes
  )
  return [o.tolist() for o in found]


def _theirs(restored, translator, texts, **options):
  pieces = ct.Pieces(restored.vocab)
  tokens = ct.translate_tokens(translator, [pieces.source(t) for t in texts], **options)
  return [pieces.ids(t) for t in tokens]


@pytest.mark.slow
def test_export_writes_our_vocabulary_start_token_and_source_eos(exported):
  restored, out = exported.restored, exported.out
  assert sorted(p.name for p in out.iterdir()) == [
    "config.json",
    "limits.json",  # ours: the longest source the model takes, for sources cut as decode.py's
    "model.bin",
    "shared_vocabulary.json",
    "vocab.json",  # ours, for text in and out with the directory alone
  ]
  max_len = restored.config.model.max_len
  assert json.loads((out / ct.LIMITS_NAME).read_text()) == {"max_len": max_len}
  assert ct.read_max_len(out) == max_len
  pieces = [restored.vocab.piece(i) for i in range(restored.vocab.vocab_size)]
  assert json.loads((out / "shared_vocabulary.json").read_text()) == pieces
  config = json.loads((out / "config.json").read_text())
  assert config["decoder_start_token"] == "<pad>" == pieces[0]  # targets shifted right with PAD
  assert (config["eos_token"], config["unk_token"]) == (pieces[1], pieces[2])
  assert config["add_source_eos"] is True and config["add_source_bos"] is False
  assert ct.Pieces(restored.vocab).source("w3 w1 nope") == ["w3", "w1", "<unk>"]
  # Cut as encode_source cuts: max_len - 1 tokens, CTranslate2 adding the EOS.
  cut = ct.Pieces(restored.vocab, max_len=3).sources(["w3 w1 w2", "w3 w1", "w3"])
  assert cut == ([["w3", "w1"], ["w3", "w1"], ["w3"]], [0])


@pytest.mark.slow
@pytest.mark.parametrize("max_extra_len", [50, 2])
def test_greedy_equals_ours_token_for_token(exported, max_extra_len):
  """Greedy search on 300 sentences, with our length limit (2 extra tokens: many sentences end at
  it): CTranslate2's output is ours, token for token."""
  restored, translator = exported.restored, exported.translator
  texts = _sentences(restored)
  ours = _ours(exported, texts, beam_size=1, max_extra_len=max_extra_len)
  theirs = _theirs(restored, translator, texts, beam_size=1, max_extra_len=max_extra_len)
  assert theirs == ours
  limited = sum(len(o) == len(t.split()) + max_extra_len for o, t in zip(ours, texts))
  assert limited > (0 if max_extra_len == 50 else 30)  # the limit was reached, and agreed on


@pytest.mark.slow
def test_beam_search_without_length_penalty_equals_ours(exported):
  """Beam 4 with alpha 0 (CTranslate2: length_penalty 0), some sentences ending at our length
  limit: the same translations (alpha > 0: see inference/ctranslate2_export.py's docstring)."""
  restored, translator = exported.restored, exported.translator
  texts = _sentences(restored)
  ours = _ours(exported, texts, beam_size=4, alpha=0.0, max_extra_len=1)
  theirs = _theirs(restored, translator, texts, beam_size=4, length_penalty=0.0, max_extra_len=1)
  assert theirs == ours
  limited = sum(len(o) == len(t.split()) + 1 for o, t in zip(ours, texts))
  assert 10 < limited < len(texts) - 10  # many, not all, end at the limit


@pytest.mark.slow
@pytest.mark.parametrize("alpha", [0.6, 1.5])
def test_beam_search_with_the_fairseq_length_penalty_equals_ours(exported, alpha):
  """With alpha > 0 CTranslate2 divides by len^alpha and stops a sentence once beam_size
  hypotheses have finished: our search with `length_penalty='fairseq'` does the same, so the
  translations agree (with the GNMT penalty they differ on some sentences)."""
  restored, translator = exported.restored, exported.translator
  texts = _sentences(restored)
  ours = _ours(exported, texts, beam_size=4, alpha=alpha, length_penalty="fairseq")
  theirs = _theirs(restored, translator, texts, beam_size=4, length_penalty=alpha)
  assert theirs == ours


def test_the_fairseq_penalty_at_the_length_limit_equals_ctranslate2(exported):
  """Alpha 1 with many sentences reaching the length limit: CTranslate2 finishes the top
  `beam_size` candidates of a sentence's last step whether they end in EOS or not, each divided
  by its own length; our search with the fairseq penalty does the same (not an EOS forced one
  step later), so the translations agree."""
  restored, translator = exported.restored, exported.translator
  texts = _sentences(restored)
  how = dict(beam_size=4, max_extra_len=2)
  ours = _ours(exported, texts, alpha=1.0, length_penalty="fairseq", **how)
  theirs = _theirs(restored, translator, texts, length_penalty=1.0, **how)
  assert theirs == ours
  limited = sum(len(o) == len(t.split()) + 2 for o, t in zip(ours, texts))
  assert limited > 10


def _prefixed(exported, count=120):
  """(texts, prefix ids, CTranslate2's target prefixes) of `count` sentences, each with a prefix
  of its first 0-3 words, and a function translating them with CTranslate2's target_prefix."""
  restored, translator = exported.restored, exported.translator
  texts = _sentences(restored, count)
  pieces = ct.Pieces(restored.vocab)
  prefixes = [" ".join(t.split()[: i % 4]) for i, t in enumerate(texts)]
  prefix_ids = [restored.vocab.encode(p) for p in prefixes]
  assert sum(map(bool, prefix_ids)) >= count * 2 // 3

  def theirs(beam, alpha):
    tokens = ct.translate_tokens(
      translator,
      [pieces.source(t) for t in texts],
      target_prefixes=[pieces.source(p) for p in prefixes],
      beam_size=beam,
      length_penalty=alpha,
    )
    return [pieces.ids(t) for t in tokens]

  return texts, prefix_ids, theirs


@pytest.mark.slow
@pytest.mark.parametrize("beam, alpha", [(1, 0.0), (4, 0.0), (4, 1.0)])
def test_the_ctranslate2_prefix_rule_equals_ctranslate2s_target_prefix(exported, beam, alpha):
  """`prefix_rule='ctranslate2'`: greedy search and beam search with the fairseq penalty, alpha 0
  and 1, translate every sentence with a target prefix as CTranslate2's `target_prefix` does,
  token for token."""
  texts, prefix_ids, theirs = _prefixed(exported)
  how = dict(beam_size=beam, alpha=alpha, length_penalty="fairseq", prefix_rule="ctranslate2")
  ours = _ours(exported, texts, prefixes=prefix_ids, **how)
  assert all(o[: len(p)] == p for o, p in zip(ours, prefix_ids))
  assert theirs(beam, alpha) == ours


@pytest.mark.slow
def test_the_forced_prefix_rule_differs_from_ctranslate2s_where_its_rules_do(exported):
  """The default `prefix_rule='forced'`, beam search without a length penalty (where counting the
  prefix's log-probability or not ranks alike): equal to CTranslate2's `target_prefix` token for
  token, but where CTranslate2's EOS rule applies: at the first step after the prefix it keeps EOS
  only as the best candidate (src/decoding.cc, update_sample_with_prefix, its issue #277), where
  ours keeps every finished candidate."""
  texts, prefix_ids, theirs = _prefixed(exported)
  how = dict(alpha=0.0, length_penalty="fairseq")
  ours = _ours(exported, texts, prefixes=prefix_ids, beam_size=4, **how)
  theirs = theirs(4, 0.0)
  # The sentences the rule touches: our beam search ended right at the prefix though EOS was not
  # the best first free token (greedy search, which takes the best, went on). CTranslate2 cannot
  # end there, so it goes on; everywhere else the two are equal. (Greedy search takes the best
  # token under either prefix rule, the rules differing in scores only: the 'ctranslate2' rule's
  # greedy program, the one the test above compiled in the module's generator, serves.)
  greedy = _ours(
    exported, texts, prefixes=prefix_ids, beam_size=1, **how, prefix_rule="ctranslate2"
  )
  ended = {i for i, (o, p) in enumerate(zip(ours, prefix_ids)) if o == p}
  ruled = {i for i in ended if greedy[i] != prefix_ids[i]}
  assert ended - ruled  # the rule's other side is met too: EOS the best, both end there
  for i in ruled:
    assert theirs[i][: len(prefix_ids[i])] == prefix_ids[i]
    assert len(theirs[i]) > len(prefix_ids[i]), i
  assert len(ruled) < len(texts) // 3  # most sentences are compared token for token
  kept = [i for i in range(len(texts)) if i not in ruled]
  assert [theirs[i] for i in kept] == [ours[i] for i in kept]


@pytest.mark.parametrize("pre_ln", [False, True])
def test_every_weight_is_mapped_pre_ln_and_separate_embeddings(tmp_path, pre_ln):
  """A random two-layer model with separate source, target and output embeddings (and, pre-LN,
  the stacks' final LayerNorms), its biases random too (drawn in numpy: no initialisation program
  to compile): greedy outputs equal ours on random sources."""
  config = tiny_config(**{"model.num_layers": 2, "model.pre_ln": pre_ln})
  config.model.share_embeddings = False
  model = build_model(config.model)
  params = random_params(config.model, seed=3)
  assert "target_embed" in params and "logits" in params["decoder"]
  assert ("final_norm" in params["encoder"]) == pre_ln
  vocab = int(config.model.vocab_size)
  pieces = peer.placeholder_pieces(vocab)
  spec = ce.transformer_spec(config.model, params, pieces)
  translator = ctranslate2.Translator(str(ce.write_model(spec, tmp_path / "m")), device="cpu")
  rng = np.random.default_rng(0)
  sources = [rng.integers(4, vocab, size=int(n)).tolist() for n in rng.integers(2, 12, size=64)]
  ours = translate_all(model, params, [s + [EOS_ID] for s in sources], beam_size=1, max_extra_len=8)
  theirs = ct.translate_tokens(
    translator, [[pieces[i] for i in s] for s in sources], beam_size=1, max_extra_len=8
  )
  index = {p: i for i, p in enumerate(pieces)}
  assert [[index[t] for t in h] for h in theirs] == [o.tolist() for o in ours]


@pytest.mark.slow
def test_quantized_exports_load_and_translate(exported, tmp_path):
  """int8 and bfloat16 weights (the latter without torch: cast through ml_dtypes) are written
  smaller and translate, within our length limit."""
  restored = exported.restored
  texts = _sentences(restored, 20)
  for quantization in ("int8", "bfloat16"):
    path = ce.export(exported.workdir, tmp_path / quantization, quantization=quantization)
    assert (path / "model.bin").stat().st_size < (exported.out / "model.bin").stat().st_size
    translator = ctranslate2.Translator(str(path), device="cpu")
    for text, ids in zip(texts, _theirs(restored, translator, texts, max_extra_len=3)):
      assert len(ids) <= len(text.split()) + 3 and all(
        3 < i < restored.vocab.vocab_size for i in ids
      )


@pytest.mark.slow
def test_other_model_types_and_ensembles_are_refused(exported, monkeypatch, tmp_path):
  restored, workdir = exported.restored, exported.workdir
  with pytest.raises(UsageError, match="checkpoint='ensemble:2': CTranslate2 runs one model"):
    ce.export(workdir, tmp_path / "e", checkpoint="ensemble:2")
  for kind in ("rnn", "rnn_attention", "decoder_only"):
    config = restored.config.copy_and_resolve_references()
    config.model.type = kind
    other = type(restored)(config, restored.params, restored.step, restored.vocab)
    monkeypatch.setattr(ce, "load_for_inference", lambda workdir, checkpoint, other=other: other)
    with pytest.raises(UsageError, match=f"model.type='{kind}': the CTranslate2 export covers"):
      ce.export(workdir, tmp_path / kind)
    assert not (tmp_path / kind).exists()  # refused before writing anything


def test_output_directory_is_checked_before_any_work(tmp_path, monkeypatch):
  (tmp_path / "full").mkdir()
  (tmp_path / "full" / "model.bin").write_text("")
  (tmp_path / "a_file").write_text("")
  with pytest.raises(UsageError, match="full': exists and is not empty; give a new directory"):
    ce.check_output(tmp_path / "full")
  with pytest.raises(UsageError, match="a_file': exists and is not a directory"):
    ce.check_output(tmp_path / "a_file")
  with pytest.raises(UsageError, match="a_file is not a directory"):
    ce.check_output(tmp_path / "a_file" / "model")
  (tmp_path / "empty").mkdir()
  assert ce.check_output(tmp_path / "empty") == tmp_path / "empty"
  assert ce.check_output(tmp_path / "new" / "model") == tmp_path / "new" / "model"
  monkeypatch.setattr(ce.os, "access", lambda path, mode: False)
  with pytest.raises(UsageError, match=f"output='.*new/model': {tmp_path} is not writable"):
    ce.check_output(tmp_path / "new" / "model")


@pytest.mark.slow
def test_command_line_exports_and_refuses_bad_input_in_one_line(exported, tmp_path):
  workdir, out = exported.workdir, exported.out
  # In this process (tests/helpers.py run_in_process): the command's own flags, runner and exit
  # status, without a new interpreter's imports (the translate command's test runs one).
  done = run_in_process(
    PROG, f"--workdir={workdir}", f"--output={tmp_path / 'q'}", "--quantization=int8"
  )
  assert done.returncode == 0, done.stderr[-2000:]
  assert "wrote the CTranslate2 model" in done.stdout and (tmp_path / "q" / "model.bin").is_file()
  for args, message in [
    ([f"--output={out}"], f"--output={out}: exists and is not empty; give a new directory"),
    (
      [f"--output={tmp_path / 'e'}", "--checkpoint=ensemble:2"],
      "--checkpoint=ensemble:2: CTranslate2 runs one model",
    ),
    ([f"--output={tmp_path / 'x'}", "--quantization=int3"], "--quantization"),
  ]:
    proc = run_in_process(PROG, f"--workdir={workdir}", *args)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert last.startswith(f"{PROG}: error: ") or "FATAL Flags parsing error" in last, last
    assert message in last, last


@pytest.mark.slow
def test_translate_command_equals_decode_py_with_the_fairseq_penalty(exported, tmp_path):
  """The export directory alone translates a file from the command line, as decode.py does
  with the same search (--length_penalty=fairseq), and scores it; a line longer than the model
  takes is cut as decode.py cuts it, with the same warning; bad input is one line."""
  words = exported.restored.config.model.max_len + 8
  texts = _sentences(exported.restored, 60) + ["", " ".join(f"w{i % 9 + 1}" for i in range(words))]
  (tmp_path / "in.txt").write_text("".join(t + "\n" for t in texts))
  (tmp_path / "ref.txt").write_text("".join(t + "\n" for t in texts))
  how = ["--beam_size=3", "--alpha=1.0", "--max_extra_len=5"]
  proc = run_py(
    "-m",
    "cli.ctranslate2_translate",
    f"--model={exported.out}",
    f"--input={tmp_path / 'in.txt'}",
    f"--output={tmp_path / 'ct2.txt'}",
    f"--reference={tmp_path / 'ref.txt'}",
    "--compute_type=float32",
    *how,
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.startswith("BLEU") and "chrF" in proc.stdout
  cut = f"1 of {len(texts)} sentences are longer than model.max_len="
  assert f"{cut}{words - 8} tokens (EOS included) and were truncated to it: line {len(texts)}" in (
    proc.stderr
  )
  ours = run_in_process(
    "decode.py",
    f"--workdir={exported.workdir}",
    "--length_penalty=fairseq",
    "--dtype=float32",  # the export's; 'auto' is bfloat16 on CPUs with native bfloat16
    f"--input={tmp_path / 'in.txt'}",
    *how,
  )
  assert ours.returncode == 0, ours.stderr[-2000:]
  assert cut in ours.stderr
  theirs = (tmp_path / "ct2.txt").read_text()
  assert theirs == ours.stdout and len(theirs.splitlines()) == len(texts)
  replicas = run_in_process(  # two replicas, length groups in flight: the same lines, in order
    "cli.ctranslate2_translate",
    f"--model={exported.out}",
    f"--input={tmp_path / 'in.txt'}",
    "--compute_type=float32",
    "--threads=1",
    "--inter_threads=2",
    *how,
  )
  assert replicas.returncode == 0 and replicas.stdout == theirs, replicas.stderr[-2000:]
  for args, message in [
    ([f"--model={tmp_path}"], f"--model={tmp_path}: no model.bin"),
    ([f"--model={exported.out}", "--beam_size=0"], "--beam_size=0"),
    ([f"--model={exported.out}", "--alpha=nan"], "--alpha=nan"),
    ([f"--model={exported.out}", "--length_penalty=gnmt"], "--length_penalty=gnmt: CTranslate2"),
    ([f"--model={exported.out}", "--stopping=exact"], "--stopping=exact: CTranslate2"),
    ([f"--model={exported.out}", "--temperature=1"], "--temperature=1.0: sampling is"),
    ([f"--model={exported.out}", "--inter_threads=0"], "--inter_threads=0"),
    ([f"--model={exported.out}", f"--output={tmp_path / 'no' / 'o.txt'}"], "does not exist"),
    (
      [f"--model={exported.out}", f"--reference={tmp_path / 'in.txt'}", "--input=/dev/null"],
      f"{len(texts)} lines",
    ),
  ]:
    proc = run_in_process("cli.ctranslate2_translate", f"--input={tmp_path / 'in.txt'}", *args)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert message in last, last
  damaged = tmp_path / "damaged"  # the export with an unreadable limit: one line, before any work
  damaged.mkdir()
  for f in exported.out.iterdir():
    (damaged / f.name).symlink_to(f)
  (damaged / ct.LIMITS_NAME).unlink()
  (damaged / ct.LIMITS_NAME).write_text('{"max_len": "32"}')
  proc = run_in_process("cli.ctranslate2_translate", f"--model={damaged}", "--input=/dev/null")
  last = proc.stderr.strip().splitlines()[-1]
  assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  assert "limits.json: max_len='32' is not a length of at least 2 tokens" in last, last


def test_the_peer_at_its_best_tries_every_gemm_path_and_threading(exported):
  """CTranslate2's configurations: each GEMM path with one replica on every core or one replica
  per core (one threading on one core), as cli.ctranslate2_translate's flags; the backend line
  is CTranslate2's own (CT2_VERBOSE=1) under the configuration's environment."""
  two = peer.peer_configurations(2)
  assert {(c.gemm, c.threading) for c in two} == {
    (g, t) for g in peer.GEMM_PATHS for t in ("intra", "inter")
  }
  inter = next(c for c in two if c.gemm == "oneDNN" and c.threading == "inter")
  assert inter.flags == ["--threads=1", "--inter_threads=2"]
  assert inter.env == {"CT2_USE_MKL": "0"}
  assert [c.threading for c in peer.peer_configurations(1)] == ["intra"] * len(peer.GEMM_PATHS)
  line = peer.backend_line(inter, exported.out)
  assert "Use Intel MKL: false; SGEMM backend: DNNL" in line, line


def test_a_configuration_that_cannot_run_is_reported_not_raised(exported, tmp_path):
  """A compute type one GEMM path lacks (oneDNN has no int16 products) fails that configuration
  only: it is reported with CTranslate2's reason and comes last; when none runs, the command
  line says so in one line."""
  source = tmp_path / "in.txt"
  source.write_text("a b c\n")
  one_dnn = peer.PeerConfiguration("oneDNN", "intra", 1)
  rows = peer.time_peer(exported.out, source, ["--compute_type=int16"], [one_dnn], runs=1)
  assert [r["configuration"] for r in rows] == [one_dnn]
  assert "int16" in rows[0]["error"] and rows[0]["seconds"] == [], rows
  proc = run_in_process(
    "cli.ctranslate2_peer",
    f"--model={exported.out}",
    f"--input={source}",
    "--cores=1",
    "--runs=1",
    "--search_flags=--beam_size=0",
  )
  last = proc.stderr.strip().splitlines()[-1]
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  assert "no configuration ran" in last and "--beam_size=0" in last, last


# ----------------------------------------------------------------------------- the bench peer
def _bench_config(beam):
  c = tiny.get_config()
  c.model.update(vocab_size=64, num_layers=1)
  c.bench.update(batch_size=4, seq_len=8, decode_len=6, beam_size=beam)
  return c


def test_bench_times_int8_products_and_the_peer_exports_the_float_weights(monkeypatch):
  """bench.py --mode=decode with model.dtype=int8: our runner decodes with the matrices quantized
  once, before the timed calls (model/quantize.py), its record says int8, and the peer is handed
  the float32 parameters; training in int8 is refused."""
  config = _bench_config(2)
  config.model.dtype = "int8"
  seen = []
  decoder = decoding.fixed_length_decoder

  def spy(*args):
    decode = decoder(*args)
    return lambda params, inputs: seen.append(params) or decode(params, inputs)

  monkeypatch.setattr(decoding, "fixed_length_decoder", spy)
  options = Options(mode="decode", steps=1, warmup=0, ctranslate2=True)
  ours = decoding.decode_runner(config, options)
  ours.call()
  ours.call()
  assert ours.record(0.1, [0.01])["dtype"] == "int8"
  (params,) = {id(p): p for p in seen}.values()  # the same quantized tree every call
  kernel = params["decoder"]["layer_0"]["ffn"]["wi"]["kernel"]
  assert isinstance(kernel, Int8Matrix) and kernel.values.dtype == np.int8
  assert all(x.dtype == np.float32 for x in jax.tree_util.tree_leaves(ours.params))
  only_int8 = dataclasses.replace(options, ctranslate2_compute_types=("int8",))
  for runner in decoding.ctranslate2_runners(config, only_int8, ours.params):
    runner.call()
    assert runner.record(0.1, [0.01])["compute_type"] == "int8"
  with pytest.raises(UsageError, match="model.dtype='int8' is for decoding only"):
    check_config(config, "train")


@pytest.mark.parametrize("beam", [1, 2])
def test_bench_peer_decodes_our_own_weights_to_the_fixed_length(beam):
  """The peer exports the parameters our decoding runner times and reads the same source rows:
  with EOS kept out of both, CTranslate2's fixed-length output equals ours; its records have
  CTRANSLATE2_FIELDS, one per compute type."""
  config = _bench_config(beam)
  options = Options(mode="decode", steps=1, warmup=0, ctranslate2=True)
  ours = decoding.decode_runner(config, options)
  runners = decoding.ctranslate2_runners(config, options, ours.params)
  decode = decoding.fixed_length_decoder(build_model(config.model), beam, 6, True)
  expected = np.asarray(decode(ours.params, decoding.decode_inputs(config)))
  cores = usable_cores()
  sides = [(c, t) for c in peer.COMPUTE_TYPES for t in peer.threadings(cores)]
  assert len(runners) == len(sides) == 2 * (1 + (cores > 1))
  for runner, (compute_type, threading) in zip(runners, sides):
    runner.call()
    record = runner.record(0.1, [0.01])
    assert set(record) == set(records.CTRANSLATE2_FIELDS)
    assert record["implementation"] == f"ctranslate2 {compute_type}, {threading}_threads={cores}"
    assert record["compute_type"] == compute_type
    inter = cores if threading == "inter" else 1
    assert (record["inter_threads"], record["intra_threads"]) == (inter, cores // inter)
    assert "SGEMM backend" in record["backend"], record["backend"]
    assert record["ctranslate2_version"] == ctranslate2.__version__
    assert record["decode_len"] == 6 and record["beam_size"] == beam
  # Both threadings decode the rows (split between 2 replicas for 'inter') to our fixed length.
  built, _ = peer.translators(config.model, ours.params, ["float32"], 2, 8)
  for (_, threading), translator in built.items():
    parts = 2 if threading == "inter" else 1
    call, ids = peer.decode_call(translator, decoding.decode_inputs(config), 64, 6, beam, parts)
    call()
    np.testing.assert_array_equal(ids(), expected)


def test_paired_with_ctranslate2_alternates_ours_and_each_compute_type(capsys):
  """--ctranslate2 --paired: three sides, ours first; the top-level speed-up is the first peer's
  (as for flax), `peer_speedups` holds each peer's; the table and a line per peer print."""
  config = _bench_config(2)
  options = Options(mode="decode", steps=2, warmup=0, ctranslate2=True)
  result = paired.bench_paired(config, options, rounds=2)
  assert set(result) == set(paired.PAIRED_FIELDS) | {"peer_speedups"}
  names = [r["implementation"] for r in result["records"]]
  cores = usable_cores()
  assert names == ["this repository"] + [
    f"ctranslate2 {c}, {t}_threads={cores}"
    for c in ("float32", "int8")
    for t in peer.threadings(cores)
  ]
  ours = result["records"][0]["step_time_s"]
  for record, speedup in zip(result["records"][1:], result["peer_speedups"]):
    assert speedup["implementation"] == record["implementation"]
    assert speedup["speedup"] == pytest.approx(record["step_time_s"] / ours)
    assert len(speedup["speedup_per_round"]) == 2
  assert result["speedup"] == result["peer_speedups"][0]["speedup"]
  json.dumps(result)
  report.print_paired(result)
  printed = capsys.readouterr().out
  assert f"speedup (ctranslate2 int8, intra_threads={cores}'s step time / ours)" in printed


def test_bench_command_line_times_ctranslate2_alone(tmp_path):
  record_path = tmp_path / "r.json"
  proc = run_in_process(
    "bench.py",
    *[
      "--config=configs/tiny.py",
      "--config.model.vocab_size=64",
      "--config.model.num_layers=1",
      "--config.bench.batch_size=4",
      "--config.bench.seq_len=8",
      "--config.bench.decode_len=5",
      "--mode=decode",
      "--ctranslate2",
      "--ctranslate2_compute_types=int8",
      "--steps=2",
      "--warmup=1",
      f"--json={record_path}",
    ],
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  record = json.loads(record_path.read_text())
  # The fastest of its threadings on this machine's cores is the record.
  assert record["implementation"].startswith("ctranslate2 int8, ") and record["decode_len"] == 5
  assert record["intra_threads"] * record["inter_threads"] == usable_cores()


def test_translate_command_has_decode_py_search_flags_and_defaults():
  """The CTranslate2 command line's search flags are decode.py's (cli/search_flags.py): the same
  names and defaults, but the length penalty (fairseq, the only one CTranslate2 has) and
  max_extra_len (decode.py's come from the workdir's config); the settings CTranslate2 cannot
  honour are refused naming the field."""
  import decode
  from cli import ctranslate2_translate as command
  from inference.ctranslate2_translate import search_options
  from model.search_settings import SearchSettings

  ours, theirs = flags.FlagValues(), flags.FlagValues()
  decode.define_flags(ours)
  command.define_flags(theirs)
  names = ("beam_size", "alpha", "length_penalty", "max_extra_len", "temperature", "top_k")
  names += ("stopping",)
  assert all(name in theirs for name in names)
  assert "prefix_rule" in ours and "prefix_rule" not in theirs  # it takes no prefix
  pairs = {n: (ours[n].default, theirs[n].default) for n in names}
  differ = {n: pair for n, pair in pairs.items() if pair[0] != pair[1]}
  # decode.py's beam, alpha, length penalty and max_extra_len come from the workdir's config
  # (eval.*; their defaults are SearchSettings', the command's).
  assert differ == {
    "beam_size": (None, 4),
    "alpha": (None, 0.6),
    "length_penalty": (None, "fairseq"),
    "max_extra_len": (None, 50),
  }
  assert search_options(SearchSettings(beam_size=3, alpha=1.0, length_penalty="fairseq")) == {
    "beam_size": 3,
    "length_penalty": 1.0,
    "max_extra_len": 50,
  }
  assert search_options(SearchSettings(beam_size=1))["beam_size"] == 1  # greedy: no penalty
  for settings, name in [
    (SearchSettings(beam_size=2), "length_penalty"),
    (SearchSettings(temperature=1.0), "temperature"),
    (SearchSettings(beam_size=2, length_penalty="fairseq", num_hypotheses=2), "num_hypotheses"),
    (SearchSettings(beam_size=2, length_penalty="fairseq", stopping="exact"), "stopping"),
  ]:
    with pytest.raises(UsageError) as caught:
      search_options(settings)
    assert caught.value.name == name
