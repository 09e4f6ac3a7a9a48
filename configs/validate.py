"""One validation of a run's config, shared by train.py, decode.py and bench.py: what can be
checked before any device work, data or file, so a bad config is one line naming the field.

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

from cli.errors import UsageError

PURPOSES = ("train", "bench_train", "bench_decode")
ATTENTION_TYPES = ("transformer", "decoder_only")  # the model types with model.attention_impl


def check_config(config, purpose: str = "train") -> None:
  """Raises UsageError naming the first field (and its value) that cannot run for `purpose`."""
  if purpose not in PURPOSES:
    raise ValueError(f"check_config: purpose {purpose!r} is not one of {PURPOSES}")
  training = purpose != "bench_decode"
  if training:
    _check_training(config)
  if purpose == "train":
    _check_schedule(config)
  else:
    _check_bench(config, decode=not training)
  _check_cudnn_length(config, training, config.data.max_len if purpose == "train" else None)


def _check_training(config) -> None:
  if config.model.dtype == "float16":
    raise UsageError(
      "config error: model.dtype='float16' cannot train here: there is no loss scaling, so small "
      "gradients underflow to zero; use bfloat16"
    )
  smoothing = config.optim.label_smoothing
  if not 0.0 <= smoothing < 1.0:
    raise UsageError(f"config error: optim.label_smoothing={smoothing!r} must be in [0, 1)")
  accum = int(config.optim.grad_accum_steps)
  if accum < 1:
    raise UsageError(f"config error: optim.grad_accum_steps={accum} must be >= 1")


def _check_schedule(config) -> None:
  for key in ("log_every_steps", "eval_every_steps", "checkpoint_every_steps"):
    if int(config[key]) < 1:
      raise UsageError(
        f"config error: {key}={config[key]} must be >= 1 (to do it only at the end, set it to "
        f"num_train_steps)"
      )


def _check_bench(config, decode: bool) -> None:
  bench = config.bench
  if int(bench.seq_len) < 2:
    raise UsageError(f"config error: bench.seq_len={bench.seq_len} must be >= 2")
  if int(bench.seq_len) > int(config.model.max_len):
    raise UsageError(
      f"config error: bench.seq_len={bench.seq_len} is longer than "
      f"model.max_len={config.model.max_len}"
    )
  if int(bench.batch_size) < 1:
    raise UsageError(f"config error: bench.batch_size={bench.batch_size} must be positive")
  if decode and (int(bench.decode_len) < 1 or int(bench.beam_size) < 1):
    raise UsageError(
      f"config error: bench.decode_len={bench.decode_len} and bench.beam_size={bench.beam_size} "
      f"must be positive"
    )


def _uses_cudnn(config) -> bool:
  return config.model.get("attention_impl") == "cudnn" and config.model.type in ATTENTION_TYPES


def _check_cudnn_length(config, training: bool, data_max_len) -> None:
  """cuDNN's masked attention takes even lengths in training steps (data.max_len, or
  bench.seq_len for bench)."""
  if not (training and _uses_cudnn(config)):
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
  """What the config asks of JAX's backend: model.attention_impl='cudnn' needs an NVIDIA GPU.
  Starts the backend: call it after `training.distributed.initialize_distributed`."""
  if not _uses_cudnn(config):
    return
  backend = jax.default_backend()
  if backend != "gpu":
    raise UsageError(
      f"config error: model.attention_impl='cudnn' needs an NVIDIA GPU, but JAX's backend here "
      f"is {backend!r}; use model.attention_impl=xla"
    )
