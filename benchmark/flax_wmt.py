"""google/flax `examples/wmt` as a benchmark baseline: its own train step and cached beam search,
loaded from a checkout of that directory and run on our config's model shape and bench batch, so
`bench.py --flax_wmt=<dir>` times both implementations the same way.

    pip download flax==0.12.8 --no-deps --no-binary :all: && tar xzf flax-*.tar.gz  # examples/wmt
    python bench.py --config=configs/bench_tiny.py --flax_wmt=flax-0.12.8/examples/wmt
    python bench.py --config=configs/bench_tiny.py --flax_wmt=flax-0.12.8/examples/wmt \
        --mode=decode --config.bench.batch_size=32 --config.bench.seq_len=32

Nothing of flax's example is copied here: its `train.py` (train_step, predict_step,
initialize_cache, TrainState, the learning-rate schedule), `models.py` and `decode.py` are
imported from the given directory and called as its own training loop calls them (`jax.pmap`, Adam
b1 0.9, b2 0.98, eps 1e-9), except that the pmap runs over the devices bench times ours on
(`config.num_devices` of this process's, `pmap_devices`), not over all local devices. Its
pipeline-only imports (`clu`, `tensorflow_text`) are stood in for by empty modules when they are
not installed. Its model is pre-LayerNorm, with sinusoidal positions and logits through the
shared embedding; its matmul FLOPs are those of our model of the same `d_model`, `d_ff`, heads,
layers and vocabulary, so MFU and tokens/s compare like for like. Decoding never ends early: EOS
is given an id the model cannot produce, so, as with ours (benchmark/timing.py), every sentence
gets exactly `decode_len` tokens. A directory or config this cannot use is a `UsageError`.
"""

from __future__ import annotations

import functools
import importlib
import pathlib
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import jax_utils

from core.errors import ArgumentError, UsageError
from training import parallel as par

# flax examples/wmt's own modules, imported by these top-level names from inside its directory.
_THEIR_MODULES = ("bleu", "decode", "input_pipeline", "models", "tokenizer", "train")
# Imported by its training loop / input pipeline only; empty stand-ins when not installed.
_PIPELINE_ONLY = {
  "clu": ("clu", "clu.deterministic_data", "clu.metric_writers", "clu.periodic_actions"),
  "tensorflow_text": ("tensorflow_text",),
}


def load(wmt_dir: str) -> types.SimpleNamespace:
  """Imports flax examples/wmt's `train`, `models` and `decode` from `wmt_dir` without letting
  them shadow this repository's `train.py` / `decode.py` (sys.modules is restored afterwards)."""
  path = pathlib.Path(wmt_dir).resolve()
  missing = [f"{m}.py" for m in ("train", "models", "decode") if not (path / f"{m}.py").is_file()]
  if missing:
    raise ArgumentError(
      "wmt_dir", wmt_dir, f"not a flax examples/wmt directory (no {', '.join(missing)})"
    )
  saved = {name: sys.modules.pop(name) for name in _THEIR_MODULES if name in sys.modules}
  standins = []
  for package, names in _PIPELINE_ONLY.items():
    try:
      importlib.import_module(package)
    except ImportError:
      for name in names:
        sys.modules[name] = types.ModuleType(name)
        standins.append(name)
  sys.path.insert(0, str(path))
  try:
    train = importlib.import_module("train")
    return types.SimpleNamespace(
      train=train, models=sys.modules["models"], decode=sys.modules["decode"]
    )
  except ImportError as e:
    raise ArgumentError("wmt_dir", wmt_dir, f"importing its train.py failed: {e}") from e
  finally:
    sys.path.remove(str(path))
    for name in _THEIR_MODULES:
      sys.modules.pop(name, None)
    for name in standins:
      sys.modules.pop(name, None)
    sys.modules.update(saved)


def model_config(wmt, model_cfg, *, decode: bool = False, deterministic: bool = False):
  """flax's TransformerConfig for our `config.model` (transformer, shared embeddings only)."""
  if model_cfg.type != "transformer":
    raise UsageError(f"model.type={model_cfg.type!r}: flax examples/wmt has only the transformer")
  return wmt.models.TransformerConfig(
    vocab_size=int(model_cfg.vocab_size),
    output_vocab_size=int(model_cfg.vocab_size),
    share_embeddings=bool(model_cfg.share_embeddings),
    logits_via_embedding=bool(model_cfg.share_embeddings),
    dtype=jnp.dtype(model_cfg.dtype),
    emb_dim=int(model_cfg.d_model),
    qkv_dim=int(model_cfg.d_model),
    mlp_dim=int(model_cfg.d_ff),
    num_heads=int(model_cfg.num_heads),
    num_layers=int(model_cfg.num_layers),
    max_len=int(model_cfg.max_len),
    dropout_rate=float(model_cfg.dropout_rate),
    attention_dropout_rate=float(model_cfg.attention_dropout_rate),
    deterministic=deterministic,
    decode=decode,
  )


def pmap_devices(config, rows: int) -> list:
  """The devices flax's pmap runs on: the first `config.num_devices` of this process's (all when
  0), as training.parallel picks ours, so both implementations get the same devices. `rows`
  (bench.batch_size) must divide over them."""
  if jax.process_count() > 1:
    raise UsageError(f"flax examples/wmt runs on one process; this job has {jax.process_count()}")
  try:
    devices = par.local_devices(config)
  except ValueError as e:
    raise UsageError(f"flax examples/wmt: {e}") from None
  if rows % len(devices):
    raise UsageError(
      f"flax examples/wmt: bench.batch_size={rows} is not divisible by the "
      f"{len(devices)} devices flax's pmap splits it over (num_devices="
      f"{config.get('num_devices', 0)}, 0 = all)"
    )
  return devices


def train_call(wmt, config, batch: dict, devices: list):
  """(call, params): `call()` runs one flax train step on `batch` ([rows, length] inputs and
  targets, split over `devices` (from `pmap_devices`) as flax's loop splits over the local
  devices) and waits for it."""
  rows, length = batch["inputs"].shape
  if rows % len(devices):
    raise UsageError(
      f"flax examples/wmt: bench.batch_size={rows} is not divisible by the "
      f"{len(devices)} devices flax's pmap splits it over"
    )
  train_cfg = model_config(wmt, config.model)
  model = wmt.models.Transformer(train_cfg.replace(deterministic=True))
  shape = (rows // len(devices), length)
  params = jax.jit(model.init)(
    jax.random.key(config.seed), jnp.ones(shape, jnp.float32), jnp.ones(shape, jnp.float32)
  )["params"]
  lr = wmt.train.create_learning_rate_schedule(  # its default rate; the value costs no time
    learning_rate=0.002, warmup_steps=int(config.optim.warmup_steps)
  )
  state = wmt.train.TrainState.create(
    apply_fn=model.apply,
    params=params,
    dynamic_scale=None,
    tx=optax.adamw(learning_rate=lr, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.0),
  )
  holder = [jax_utils.replicate(state, devices=devices)]
  step = jax.pmap(
    functools.partial(
      wmt.train.train_step,
      config=train_cfg,
      learning_rate_fn=lr,
      label_smoothing=float(config.optim.label_smoothing),
    ),
    axis_name="batch",
    donate_argnums=(0,),
    devices=devices,
  )
  # [devices, rows / devices, length], as flax's loop shards its batches (common_utils.shard)
  sharded = {
    k: np.asarray(batch[k]).reshape(len(devices), -1, length) for k in ("inputs", "targets")
  }
  rngs = jax.random.split(jax.random.key(config.seed + 1), len(devices))

  def call():
    holder[0], metrics = step(holder[0], sharded, dropout_rng=rngs)
    jax.block_until_ready((holder[0], metrics))

  return call, params


def decode_call(wmt, config, inputs, decode_len: int, beam_size: int):
  """(call, params): `call()` beam-searches `inputs` [rows, src_len] on one device with flax's
  predict_step (its cache and beam search), `decode_len` tokens per sentence, and returns
  [rows, decode_len] ids."""
  cfg = model_config(wmt, config.model, deterministic=True)
  predict_cfg = cfg.replace(decode=True)
  rows, length = inputs.shape
  model = wmt.models.Transformer(cfg)
  params = jax.jit(model.init)(
    jax.random.key(config.seed),
    jnp.ones((rows, length), jnp.float32),
    jnp.ones((rows, decode_len), jnp.float32),
  )["params"]
  # flax's beam search emits max_decode_len - 1 tokens after a dummy first one.
  max_len = decode_len + 1
  never_eos = int(config.model.vocab_size)  # no logit has this id: no hypothesis ever finishes
  init_cache = jax.jit(
    functools.partial(wmt.train.initialize_cache, max_decode_len=max_len, config=predict_cfg)
  )
  predict = jax.jit(
    functools.partial(wmt.train.predict_step, config=predict_cfg, beam_size=beam_size),
    static_argnums=(3, 4),
  )

  def call():
    return predict(inputs, params, init_cache(inputs), never_eos, max_len).block_until_ready()

  return call, params
