"""Decoding benchmarks: our fixed-length decoding of random source sentences (exactly
`bench.decode_len` tokens per sentence with beam `bench.beam_size`, EOS never chosen, so every run
does the same work), flax examples/wmt's cached beam search on the same shape, and CTranslate2's
beam search of our own parameters at each compute type (benchmark/ctranslate2.py).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from benchmark import ctranslate2 as ct2
from benchmark import flax_wmt
from benchmark.options import Options
from benchmark.peak import (
  own_peak_memory,
  peak_memory,
)
from benchmark.records import (
  Runner,
  count_params,
  environment,
  time_stats,
)
from core.cpu import uint8_int8_products, usable_cores
from core.errors import RunError, UsageError
from model import decoder_state, search
from model.build import build_model, init_variables
from model.config import INT8
from model.quantize import quantize_matrices
from model.special_tokens import EOS_ID, PAD_ID


# ----------------------------------------------------------------------------- inputs
def source_ids(rng, rows: int, length: int, vocab: int):
  """[rows, length] int32 random ids in [4, vocab) (no special tokens), the last one EOS."""
  ids = rng.integers(4, vocab, size=(rows, length), dtype=np.int32)
  ids[:, -1] = EOS_ID
  return ids


def without_eos(step_fn):
  """A model/search.py step function whose EOS logit is -inf: searches never finish early."""

  def step(ids, cache):
    logits, cache = step_fn(ids, cache)
    return logits.at[:, EOS_ID].set(-jnp.inf), cache

  return step


def fixed_length_decoder(model, beam_size: int, decode_len: int, use_cache: bool):
  """A jitted `(params, inputs [batch, src_len]) -> ids [batch, decode_len]` that runs
  model/decoder_state.py's step functions under model/search.py's greedy (beam_size 1) or beam
  search with EOS impossible, so it always produces exactly `decode_len` tokens per sentence."""

  def run(params, inputs):
    rows = inputs.shape[0]
    step, cache, grow, segment = decoder_state.decoder_state(
      model, params, inputs, decode_len, use_cache
    )
    if beam_size == 1:
      return search.greedy_search(
        without_eos(step), cache, rows, decode_len, grow=grow, segment=segment
      )
    ids, _ = search.beam_search(
      without_eos(step), cache, rows, decode_len, beam_size=beam_size, grow=grow, segment=segment
    )
    return ids[:, 0]

  return jax.jit(run)


def random_params(config, model, device):
  """The randomly initialised parameters (seed `config.seed`) that our decoding is timed with, on
  `device`."""
  init = jax.jit(
    lambda rng: nn.unbox(init_variables(model, rng))["params"],
    out_shardings=jax.sharding.SingleDeviceSharding(device),
  )
  return init(jax.random.key(config.seed))


def decode_inputs(config):
  """The [bench.batch_size, bench.seq_len] random source rows every decoding benchmark reads."""
  return source_ids(
    np.random.default_rng(config.seed),
    int(config.bench.batch_size),
    int(config.bench.seq_len),
    int(config.model.vocab_size),
  )


def _decode_record(
  config,
  options,
  device,
  implementation: str,
  ids,
  first: float,
  times,
  n_params: int,
  memory_before=None,
  any_ids: bool = False,
) -> dict:
  """A decoding record (DECODE_FIELDS) after checking that `ids` holds exactly bench.decode_len
  tokens for each of the bench.batch_size sentences: no EOS or PAD among them unless `any_ids`
  (flax's search has no EOS here, so any id may appear). `memory_before`: the devices' memory
  peak before the run (None: not measured)."""
  rows, decode_len = int(config.bench.batch_size), int(config.bench.decode_len)
  ids = np.asarray(ids)
  if ids.shape != (rows, decode_len) or (not any_ids and np.any((ids == EOS_ID) | (ids == PAD_ID))):
    raise RunError(
      f"fixed-length decoding produced short rows (shape {ids.shape}); "
      f"the timing would not be comparable"
    )
  rec = {"mode": "decode", "implementation": implementation, **time_stats(first, times)}
  rec["sent_per_s"] = rows / rec["step_time_s"]
  rec["out_tokens_per_s"] = rows * decode_len / rec["step_time_s"]
  rec.update(
    params=n_params,
    decode_len=decode_len,
    beam_size=int(config.bench.beam_size),
    decode_cache=options.decode_cache,
    peak_memory_bytes=None if memory_before is None else own_peak_memory(memory_before),
    **environment(config, [device], options),
  )
  return rec


def decode_runner(config, options: Options, flax: bool = False) -> Runner:
  """Fixed-length decoding of random source sentences on one device with model/search.py (or,
  with `flax`, flax examples/wmt's cached beam search from `options.flax_wmt`), with the cache as
  `options.decode_cache` says. The record has DECODE_FIELDS, and building it checks that every
  sentence got bench.decode_len tokens. Ours keeps its parameters in the runner (`params`)."""
  use_cache = options.decode_cache
  memory_before = peak_memory(jax.local_devices())
  rows, length = int(config.bench.batch_size), int(config.bench.seq_len)
  decode_len, beam = int(config.bench.decode_len), int(config.bench.beam_size)
  model = build_model(config.model)
  device = jax.local_devices()[0]
  inputs = jax.device_put(decode_inputs(config), device)
  out = []
  params = None
  if flax:
    if config.model.dtype == INT8:
      raise UsageError("flax examples/wmt has no int8 products: set config.model.dtype to a float")
    if not use_cache:
      raise UsageError("flax examples/wmt decodes only with its cache (decode_cache=True)")
    if beam == 1:
      raise UsageError("flax examples/wmt has only beam search: set config.bench.beam_size >= 2")
    flax_decode, flax_params = flax_wmt.decode_call(
      flax_wmt.load(options.flax_wmt), config, inputs, decode_len, beam
    )
    n_params = count_params(flax_params)
    implementation = "flax examples/wmt"

    def call():
      out[:] = [flax_decode()]
  else:
    params = random_params(config, model, device)
    n_params = count_params(params)
    decode = fixed_length_decoder(model, beam, decode_len, use_cache)
    implementation = "this repository"
    # int8: quantized once, untimed, as decode.py does at load; `params` stay float32 (a peer
    # exports them).
    timed = params
    if config.model.dtype == INT8:
      uint8 = uint8_int8_products(device.platform)  # as inference/restore.py
      timed = jax.jit(quantize_matrices, static_argnums=(1, 2))(params, 0, uint8)

    def call():
      out[:] = [decode(timed, inputs).block_until_ready()]

  def record(first, times):
    return _decode_record(
      config,
      options,
      device,
      implementation,
      out[0],
      first,
      times,
      n_params,
      memory_before,
      any_ids=flax,
    )

  name = f"decode_{'cache' if use_cache else 'nocache'}_b{rows}_l{length}"
  return Runner(name, call, record, params)


def ctranslate2_runners(config, options: Options, params=None) -> list[Runner]:
  """CTranslate2's fixed-length decoding (benchmark/ctranslate2.py) of the same source rows as
  `decode_runner`: one runner per compute type of `options.ctranslate2_compute_types` and per
  threading on this machine's cores (`ct2.threadings`), compute type first, of our Transformer
  with `params` (those `decode_runner` times; None: initialised the same way). The records have
  CTRANSLATE2_FIELDS; CTranslate2 runs on this machine's CPU."""
  version = ct2.check_model(config.model)
  device = jax.local_devices()[0]
  if params is None:
    params = random_params(config, build_model(config.model), device)
  rows, length = int(config.bench.batch_size), int(config.bench.seq_len)
  decode_len, beam = int(config.bench.decode_len), int(config.bench.beam_size)
  vocab = int(config.model.vocab_size)
  n_params = count_params(params)
  cores = usable_cores()
  translators, backend = ct2.translators(
    config.model, params, options.ctranslate2_compute_types, cores, max(length, decode_len)
  )
  runners = []
  for (compute_type, threading), translator in translators.items():
    run = ct2.PeerConfiguration("default", threading, cores)
    call, ids = ct2.decode_call(
      translator, decode_inputs(config), vocab, decode_len, beam, run.replicas
    )
    name = f"ctranslate2 {compute_type}, {threading}_threads={cores}"

    def record(first, times, compute_type=compute_type, ids=ids, name=name, run=run):
      rec = _decode_record(config, options, device, name, ids(), first, times, n_params)
      rec.update(
        device_kind="cpu",
        compute_type=compute_type,
        intra_threads=run.threads,
        inter_threads=run.replicas,
        backend=backend,
        ctranslate2_version=version,
      )
      return rec

    runners.append(
      Runner(f"ctranslate2_{compute_type}_{threading}_b{rows}_l{length}", call, record)
    )
  return runners
