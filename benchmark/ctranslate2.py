"""CTranslate2 (OpenNMT's inference engine for CPUs and GPUs) as a decoding peer: the bench
model's own parameters exported with inference/ctranslate2_export.py, then its beam search timed
on the same source batch and lengths as ours, at one or more compute types (float32, int8, ...).

    pip install 'attention-jax[ctranslate2]'
    python bench.py --config=configs/bench_tiny.py --mode=decode --ctranslate2 --paired

The source rows are ours (random ids ending in EOS) given as their token strings, without the EOS
(the exported model appends it). Every sentence gets exactly `decode_len` tokens:
min_decoding_length = max_decoding_length = decode_len keeps EOS out until the last step, which
ends every hypothesis. The translator uses all of this machine's cores in one replica
(intra_threads = os.cpu_count(), inter_threads 1), as a server decoding one batch at a time would.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

from inference import ctranslate2_export as export
from model.special_tokens import NUM_SPECIAL, PAD_ID, SPECIAL_PIECES

COMPUTE_TYPES = ("float32", "int8")  # bench.py's default for --ctranslate2_compute_types


def placeholder_pieces(vocab_size: int) -> list[str]:
  """A vocabulary for a model without one: our special pieces, then `<id4>`, `<id5>`, ..."""
  return list(SPECIAL_PIECES) + [f"<id{i}>" for i in range(NUM_SPECIAL, vocab_size)]


def check_model(model_cfg) -> str:
  """CTranslate2's version, or a UsageError when it is not installed or cannot run the model of
  `model_cfg` (config.model): before any work."""
  version = export.import_ctranslate2().__version__
  export.check_model_type(model_cfg)
  return version


def translators(model_cfg, params, compute_types, threads: int, longest: int) -> dict:
  """{compute type: ctranslate2.Translator} of our Transformer (`model_cfg`, `params`), exported
  once in float32 to a temporary directory; each translator converts the weights to its compute
  type as it loads them, and holds them in memory (the directory is gone when this returns). One
  replica each, on `threads` threads; positions up to `longest` (source or output tokens)."""
  ctranslate2 = export.import_ctranslate2()
  spec = export.transformer_spec(
    model_cfg,
    params,
    placeholder_pieces(int(model_cfg.vocab_size)),
    positions=max(export.POSITIONS, longest + 1),
  )
  with tempfile.TemporaryDirectory(prefix="bench_ctranslate2_") as tmp:
    path = export.write_model(spec, os.path.join(tmp, "model"))
    return {
      c: ctranslate2.Translator(
        str(path), device="cpu", compute_type=c, inter_threads=1, intra_threads=threads
      )
      for c in compute_types
    }


def decode_call(translator, inputs, vocab_size: int, decode_len: int, beam_size: int):
  """(call, ids): `call()` translates the source rows `inputs` ([rows, src_len] ids below
  `vocab_size`, each ending in EOS) with `translator`, `decode_len` tokens per sentence, beam
  `beam_size`; `ids()` gives the last call's best hypotheses as [rows, decode_len] ids, a short
  one padded with PAD (the timed call does not convert them)."""
  names = placeholder_pieces(vocab_size)
  index = {p: i for i, p in enumerate(names)}
  sources = [[names[i] for i in row[:-1]] for row in np.asarray(inputs)]
  out = []

  def call():
    out[:] = translator.translate_batch(
      sources,
      beam_size=beam_size,
      min_decoding_length=decode_len,
      max_decoding_length=decode_len,
      max_input_length=0,
    )

  def ids():
    ids = np.full((len(out), decode_len), PAD_ID, np.int64)
    for row, result in zip(ids, out):
      tokens = [index[t] for t in result.hypotheses[0]][:decode_len]
      row[: len(tokens)] = tokens
    return ids

  return call, ids
