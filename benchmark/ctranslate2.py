"""CTranslate2 (OpenNMT's inference engine for CPUs and GPUs) as a decoding peer: the bench
model's own parameters exported with inference/ctranslate2_export.py, then its beam search timed
on the same source batch and lengths as ours, at one or more compute types (float32, int8, ...).

    pip install 'attention-jax[ctranslate2]'
    python bench.py --config=configs/bench_tiny.py --mode=decode --ctranslate2 --paired

The source rows are ours (random ids ending in EOS) given as their token strings, without the EOS
(the exported model appends it). Every sentence gets exactly `decode_len` tokens:
min_decoding_length = max_decoding_length = decode_len keeps EOS out until the last step, which
ends every hypothesis. Each compute type is timed in both of CTranslate2's threadings on this
machine's cores (`THREADINGS`): one replica on all of them, and one replica per core with the
batch split between them; the faster is the peer at its best. Its matrix library is the one this
process's CTranslate2 chose when imported (`CT2_USE_MKL=0` or 1 in the environment selects
another: `GEMM_PATHS`); `backend_line` records which.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from inference import ctranslate2_export as export
from inference.ctranslate2_translate import import_ctranslate2
from model.special_tokens import NUM_SPECIAL, PAD_ID, SPECIAL_PIECES

COMPUTE_TYPES = ("float32", "int8")  # bench.py's default for --ctranslate2_compute_types


def placeholder_pieces(vocab_size: int) -> list[str]:
  """A vocabulary for a model without one: our special pieces, then `<id4>`, `<id5>`, ..."""
  return list(SPECIAL_PIECES) + [f"<id{i}>" for i in range(NUM_SPECIAL, vocab_size)]


def check_model(model_cfg) -> str:
  """CTranslate2's version, or a UsageError when it is not installed or cannot run the model of
  `model_cfg` (config.model): before any work."""
  version = import_ctranslate2().__version__
  export.check_model_type(model_cfg)
  return version


# 'intra': one replica on every core (intra_threads = cores); 'inter': one replica per core
# (inter_threads = cores, one thread each), a batch split into one part per replica.
THREADINGS = ("intra", "inter")


def threadings(cores: int) -> tuple[str, ...]:
  """The threadings that differ on `cores` cores (one core: 'intra' alone)."""
  return THREADINGS if cores > 1 else THREADINGS[:1]


def translators(model_cfg, params, compute_types, cores: int, longest: int):
  """({(compute type, threading): ctranslate2.Translator}, backend) of our Transformer
  (`model_cfg`, `params`), exported once in float32 to a temporary directory; each translator
  converts the weights to its compute type as it loads them, and holds them in memory (the
  directory is gone when this returns). Each compute type in each of `threadings(cores)`;
  positions up to `longest` (source or output tokens). `backend`: what CTranslate2 says it
  computes with in this process's environment (`backend_line`)."""
  ctranslate2 = import_ctranslate2()
  spec = export.transformer_spec(
    model_cfg,
    params,
    placeholder_pieces(int(model_cfg.vocab_size)),
    positions=max(export.POSITIONS, longest + 1),
  )
  with tempfile.TemporaryDirectory(prefix="bench_ctranslate2_") as tmp:
    path = export.write_model(spec, os.path.join(tmp, "model"))
    built = {}
    for c in compute_types:
      for threading in threadings(cores):
        run = PeerConfiguration("default", threading, cores)
        built[c, threading] = ctranslate2.Translator(
          str(path),
          device="cpu",
          compute_type=c,
          inter_threads=run.replicas,
          intra_threads=run.threads,
        )
    backend = backend_line(PeerConfiguration("default", "intra", cores), path)
  return built, backend


def decode_call(
  translator, inputs, vocab_size: int, decode_len: int, beam_size: int, parts: int = 1
):
  """(call, ids): `call()` translates the source rows `inputs` ([rows, src_len] ids below
  `vocab_size`, each ending in EOS) with `translator`, `decode_len` tokens per sentence, beam
  `beam_size`, the rows split into `parts` batches (one per replica of an 'inter' translator);
  `ids()` gives the last call's best hypotheses as [rows, decode_len] ids, a short one padded
  with PAD (the timed call does not convert them)."""
  names = placeholder_pieces(vocab_size)
  index = {p: i for i, p in enumerate(names)}
  sources = [[names[i] for i in row[:-1]] for row in np.asarray(inputs)]
  out = []
  part = -(-len(sources) // parts) if parts > 1 else 0  # 0: the whole batch at once

  def call():
    out[:] = translator.translate_batch(
      sources,
      max_batch_size=part,
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


# ----------------------------------------------------------------------------- at its best
# CTranslate2's matrix library is chosen when it is imported: MKL on Intel CPUs, oneDNN
# elsewhere; `CT2_USE_MKL` overrides the choice (0: oneDNN on any x86 CPU, 1: MKL where it runs).
GEMM_PATHS = {"default": {}, "oneDNN": {"CT2_USE_MKL": "0"}, "MKL": {"CT2_USE_MKL": "1"}}
# What CT2_VERBOSE=1 prints at its first model's load that says how it computes.
BACKEND_KEYS = ("Selected ISA", "Use Intel MKL", "SGEMM backend")


class PeerConfiguration(NamedTuple):
  """One way to run CTranslate2 on `cores` cores: a GEMM path (`GEMM_PATHS`' key: environment
  set before it is imported) and a threading: 'intra' one replica on every core
  (intra_threads = cores), 'inter' one replica per core (inter_threads = cores, one thread each,
  length groups in flight side by side)."""

  gemm: str
  threading: str
  cores: int

  @property
  def env(self) -> dict:
    return dict(GEMM_PATHS[self.gemm])

  @property
  def replicas(self) -> int:
    """inter_threads: one replica, or one per core."""
    return self.cores if self.threading == "inter" else 1

  @property
  def threads(self) -> int:
    """intra_threads: each replica's share of the cores."""
    return self.cores // self.replicas

  @property
  def flags(self) -> list[str]:
    """`python -m cli.ctranslate2_translate`'s threading flags."""
    return [f"--threads={self.threads}", f"--inter_threads={self.replicas}"]

  def name(self) -> str:
    return f"{self.gemm} GEMM, {self.threading}_threads={self.cores}"


def peer_configurations(cores: int) -> list[PeerConfiguration]:
  """Every GEMM path with both threadings on `cores` cores (one threading on one core)."""
  threadings = ("intra",) if cores == 1 else ("intra", "inter")
  return [PeerConfiguration(g, t, cores) for g in GEMM_PATHS for t in threadings]


def backend_line(configuration: PeerConfiguration, model_dir) -> str:
  """What CTranslate2 says it computes with under `configuration`, from a process that loads
  `model_dir` with `CT2_VERBOSE=1`: its lines naming the instruction set, MKL and the float32
  GEMM backend, joined ('Selected ISA: AVX2; Use Intel MKL: false; SGEMM backend: DNNL
  (packed: false)'); '' when it prints none."""
  code = (
    "import ctranslate2, sys; "
    "ctranslate2.Translator(sys.argv[1], device='cpu', inter_threads=1, intra_threads=1)"
  )
  env = {**os.environ, **configuration.env, "CT2_VERBOSE": "1"}
  run = subprocess.run(
    [sys.executable, "-c", code, str(model_dir)], env=env, capture_output=True, text=True
  )
  found = []
  for line in (run.stderr + run.stdout).splitlines():
    for key in BACKEND_KEYS:
      if key in line:
        found.append(line[line.index(key) :].strip())
  return "; ".join(found)


def time_peer(
  model_dir,
  input_path,
  search_flags: Sequence[str],
  configurations: Sequence[PeerConfiguration],
  runs: int = 3,
  pin: str | None = None,
) -> list[dict]:
  """Whole-process seconds of `python -m cli.ctranslate2_translate --model=model_dir
  --input=input_path` under each configuration (its environment and threading flags, then
  `search_flags`), the configurations taking turns `runs` times after one untimed round, each
  process pinned to the CPUs `pin` names (taskset's list, e.g. '0') when given. Returns per
  configuration {'configuration', 'backend', 'seconds': [...], 'median'}, fastest median
  first: the first is the peer at its best on this machine. A configuration whose backend line
  and threading repeat an earlier one's (its default path is oneDNN's on AMD CPUs, MKL's on
  Intel's) is left out. A configuration whose first (untimed) run fails, such as a compute type
  its GEMM path does not offer, is timed no more and comes last, with 'error' (the process's
  last line of output) in place of a median. Translations go nowhere. Raises RuntimeError when a
  timed run fails."""
  rows, seen = [], set()
  for c in configurations:
    backend = backend_line(c, model_dir)
    if (backend, c.threading) not in seen:  # another path's name for the same library
      seen.add((backend, c.threading))
      rows.append({"configuration": c, "backend": backend, "seconds": []})
  prefix = ["taskset", "-c", pin] if pin else []
  for round_ in range(runs + 1):
    for row in (r for r in rows if "error" not in r):
      c = row["configuration"]
      command = [
        *prefix,
        sys.executable,
        "-m",
        "cli.ctranslate2_translate",
        f"--model={model_dir}",
        f"--input={input_path}",
        "--output=/dev/null",
        *c.flags,
        *search_flags,
      ]
      start = time.perf_counter()
      run = subprocess.run(command, env={**os.environ, **c.env}, capture_output=True, text=True)
      if run.returncode:
        last = (run.stderr + run.stdout).strip().splitlines()[-1:] or [f"exit {run.returncode}"]
        if round_:
          raise RuntimeError(f"CTranslate2 under {c.name()} failed: {last[0]}")
        row["error"] = last[0]
      elif round_:
        row["seconds"].append(time.perf_counter() - start)
  for row in rows:
    row["median"] = float(np.median(row["seconds"])) if row["seconds"] else float("inf")
  return sorted(rows, key=lambda r: r["median"])
