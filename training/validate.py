"""One validation of a run's config, shared by train.py and bench.py: what can be checked before
any device work, data or file, so a bad config is one line naming the field and its value. Every
field is checked against its rule in configs/common.py, the model's declared in model/config.py
(type and range: NaN and infinities are refused), then the combinations that cannot run.

    check_config(config, "train")         # train.py, before the workdir is touched
    check_config(config, "bench_train")   # bench.py: the bench batch instead of the data
    check_config(config, "bench_decode")
    check_backend(config)                 # once JAX may start its backend (after a multi-host
                                          # job is joined): what the config asks of the devices

Checks that need the devices or the data live beside what they check: the mesh and the
data-parallel split in training/parallel.py, the vocabulary's size in training/loop.py.
"""

from __future__ import annotations

import jax
from absl import logging

from configs.common import FIELDS
from core.cpu import native_dtype
from core.errors import UsageError
from core.rules import RuleError
from data import multi30k
from model.build import hyperparameters
from model.config import AUTO, INT8
from model.special_tokens import NUM_SPECIAL

PURPOSES = ("train", "bench_train", "bench_decode")
ATTENTION_TYPES = ("transformer", "decoder_only")  # the model types with model.attention_impl


def check_config(config, purpose: str = "train") -> None:
  """Raises UsageError naming the first field (and its value) that cannot run for `purpose`."""
  if purpose not in PURPOSES:
    raise ValueError(f"check_config: purpose {purpose!r} is not one of {PURPOSES}")
  check_fields(config)
  _check_model(config)
  training = purpose != "bench_decode"
  if training:
    _check_training(config)
  if purpose == "train":
    _check_data(config)
  else:
    _check_bench(config)
  _check_cudnn_length(config, training, config.data.max_len if purpose == "train" else None)


def check_fields(config) -> None:
  """Each field the config has against its rule (configs/common.py FIELDS)."""
  for name, field in FIELDS.items():
    node, *path = name.split(".")
    value = config.get(node)
    for key in path:
      value = None if value is None else value.get(key)
    if value is None:
      continue  # not a field of this config (e.g. one stored by an older version)
    try:
      field.rule.check(value)
    except RuleError as e:
      raise UsageError(f"config error: {name}={value!r} {e}") from None


def _check_model(config) -> None:
  """The model fields together (d_model and num_heads, cuDNN's dtype, ...): the model's own
  checks, run now on its config rather than after the data pipeline has run."""
  model_cfg = config.model.to_dict()
  model_cfg["vocab_size"] = max(int(model_cfg["vocab_size"]), NUM_SPECIAL + 1)  # 0 = fit later
  if model_cfg.get("dtype") == AUTO:  # resolved by check_backend, which sees the devices
    model_cfg["dtype"] = "float32"
  try:
    hyperparameters(model_cfg)
  except ValueError as e:
    raise UsageError(str(e)) from None


def _check_training(config) -> None:
  if config.model.dtype == INT8:
    raise UsageError(
      "config error: model.dtype='int8' is for decoding only (int8 products from trained "
      "matrices); train in float32 or bfloat16"
    )
  if config.model.dtype == "float16":
    raise UsageError(
      "config error: model.dtype='float16' cannot train here: there is no loss scaling, so small "
      "gradients underflow to zero; use bfloat16"
    )


def _check_data(config) -> None:
  data = config.data
  stopping = config.get("early_stopping")
  if (
    stopping and stopping.patience and stopping.metric == "bleu" and not config.eval.bleu_sentences
  ):
    raise UsageError(
      "config error: early_stopping.metric='bleu' needs eval.bleu_sentences > 0 (the val "
      "sentences BLEU is measured on); set it, or early_stopping.metric=loss"
    )
  if data.name == "synthetic" and data.synthetic_min_len > data.synthetic_max_len:
    raise UsageError(
      f"config error: data.synthetic_min_len={data.synthetic_min_len} is larger than "
      f"data.synthetic_max_len={data.synthetic_max_len}"
    )
  if data.name == multi30k.NAME and not data.dir:  # fetched: the splits and languages it has
    try:
      if data.url:
        multi30k.check_url(data.url)
      for field in ("train_split", "eval_split"):
        multi30k.check(data[field], (data.source_lang, data.target_lang), f"data.{field}")
    except ValueError as e:
      raise UsageError(f"config error: {e}") from None


def _check_bench(config) -> None:
  bench = config.bench
  if int(bench.seq_len) > int(config.model.max_len):
    raise UsageError(
      f"config error: bench.seq_len={bench.seq_len} is longer than "
      f"model.max_len={config.model.max_len}"
    )


def uses_cudnn(config) -> bool:
  """Whether the model attends with cuDNN's kernel: model.attention_impl='cudnn' on a model type
  that has the option (ATTENTION_TYPES)."""
  return config.model.get("attention_impl") == "cudnn" and config.model.type in ATTENTION_TYPES


def _check_cudnn_length(config, training: bool, data_max_len) -> None:
  """cuDNN's masked attention takes even lengths in training steps (data.max_len, or
  bench.seq_len for bench)."""
  if not (training and uses_cudnn(config)):
    return
  name, length = (
    ("data.max_len", data_max_len)
    if data_max_len is not None
    else ("bench.seq_len", config.bench.seq_len)
  )
  if int(length) % 2:
    raise UsageError(
      f"config error: model.attention_impl='cudnn' needs an even {name} when training "
      f"(cuDNN's masked attention takes even lengths), got {length}"
    )


def check_backend(config) -> None:
  """What the config asks of JAX's backend: model.attention_impl='cudnn' needs an NVIDIA GPU;
  model.dtype='auto' becomes, in the config itself, the dtype the backend's devices multiply
  fastest (core/cpu.py), so that checkpoints and logs name the dtype used. Starts the backend:
  call it after `cluster.distributed.initialize_distributed`."""
  if config.model.get("dtype") == AUTO:
    config.model.dtype, why = native_dtype(jax.default_backend())
    logging.info("model.dtype=%s (%s)", config.model.dtype, why)
  if not uses_cudnn(config):
    return
  backend = jax.default_backend()
  if backend != "gpu":
    raise UsageError(
      f"config error: model.attention_impl='cudnn' needs an NVIDIA GPU, but JAX's backend here "
      f"is {backend!r}; use model.attention_impl=xla"
    )
