"""Helpers shared by tests: the repository's paths; a tiny config and batches; train a tiny run and
read back what it saved; count compilations; run a command line as a user does (a subprocess) or,
where a new interpreter adds nothing, in this process."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import io
import json
import logging
import os
import pathlib
import runpy
import socket
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
from absl import app as absl_app
from absl import command_name, flags
from absl import logging as absl_logging
from flax import traverse_util

from configs import common
from model.build import abstract_params
from training import checkpoint as ckpt
from training.loop import train

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


# ----------------------------------------------------------------------------- configs, batches
def tiny_config(**overrides):
  """A one-layer, 32-wide Transformer on the synthetic task, 20 steps, no evaluation or periodic
  checkpoint; `overrides`: flattened fields ("model.d_model": 64, num_devices=1)."""
  c = common.base_config()
  c.model.update(
    d_model=32, d_ff=64, num_heads=4, num_layers=1, dropout_rate=0.0, max_len=32, vocab_size=36
  )
  c.data.update(
    name="synthetic",
    tokens_per_batch=256,
    max_len=16,
    synthetic_num_train=2000,
    synthetic_num_eval=64,
    synthetic_max_len=6,
  )
  c.optim.update(warmup_steps=10, learning_rate=1.0, label_smoothing=0.1)
  c.num_train_steps = 20
  c.log_every_steps = 5
  c.eval_every_steps = 1000
  c.checkpoint_every_steps = 1000
  c.eval.bleu_sentences = 0
  c.checkpoint.async_save = False
  c.update_from_flattened_dict(overrides)
  return c


def random_params(config, seed=0):
  """numpy parameters of the model `config` describes: matrices and biases drawn at 1/sqrt(fan)
  scale, LayerNorm scales 1."""
  return _drawn(abstract_params(config), seed)


def numpy_params(model, *init_args, seed=0):
  """numpy parameters of the tree `model.init(key, *init_args)` makes (traced only: compiling an
  initialization takes seconds), drawn as `random_params` draws them."""
  return _drawn(nn.unbox(jax.eval_shape(model.init, jax.random.key(0), *init_args)["params"]), seed)


def _drawn(shapes, seed):
  """A parameter tree of `shapes`' leaves' shapes, in numpy float32: `random_params`' draws."""
  rng = np.random.default_rng(seed)
  flat = traverse_util.flatten_dict(shapes)
  draw = lambda x: rng.standard_normal(x.shape) / np.sqrt(x.shape[-1])
  return traverse_util.unflatten_dict(
    {
      p: (np.ones(x.shape) if p[-1] == "scale" else draw(x)).astype(np.float32)
      for p, x in flat.items()
    }
  )


def fixed_batches(n=5, rows=16, length=8, seed=0):
  """Deterministic unpacked batches in the pipeline's format."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    lens = rng.integers(3, length + 1, rows)
    b = {}
    for side in ("inputs", "targets"):
      tok = rng.integers(4, 36, (rows, length)).astype(np.int32)
      valid = np.arange(length)[None] < lens[:, None]
      tok = np.where(valid, tok, 0)
      tok[np.arange(rows), lens - 1] = 1
      b[side] = tok
      b[f"{side}_segmentation"] = valid.astype(np.int32)
      b[f"{side}_position"] = np.where(valid, np.arange(length)[None], 0).astype(np.int32)
    out.append(b)
  return out


def make_parallel(config):
  """The config's `Parallel` (training/parallel.py): its initial state, placed step and so on."""
  from training.run_steps import build_steps

  return build_steps(config)[1]


# ----------------------------------------------------------------------------- trained runs
# train.py's flags of the tiny run decoded by tests/test_decode.py (sentences of 4..6 words and
# model.max_len 8: every decode batch has one shape [rows, 8]) and, trained longer, of
# tests/test_translator.py's runs.
DECODE_TRAIN_FLAGS = [
  "--config=configs/tiny.py",
  "--config.num_devices=1",
  "--config.num_train_steps=4",
  "--config.checkpoint_every_steps=2",
  "--config.eval_every_steps=1000",
  "--config.log_every_steps=2",
  "--config.model.d_model=32",
  "--config.model.d_ff=64",
  "--config.model.num_layers=1",
  "--config.data.synthetic_num_train=200",
  "--config.data.synthetic_num_eval=16",
  "--config.data.synthetic_max_len=6",
  "--config.data.max_len=8",
  "--config.model.max_len=8",
  "--config.data.tokens_per_batch=256",
  "--config.eval.bleu_sentences=0",
  "--config.eval.num_batches=1",
]
# The model types of tests/test_translator.py: the same run trained longer (they must translate
# something) and with room for over-long inputs.
MODEL_TYPES = ("transformer", "rnn", "rnn_attention", "decoder_only")
LONGER = {
  "--config.num_train_steps": "150",
  "--config.checkpoint_every_steps": "150",
  "--config.log_every_steps": "150",
  "--config.model.max_len": "24",
}


def train_run(config, workdir):
  return train(config, pathlib.Path(workdir))


def train_losses(workdir) -> dict:
  """{step: loss} of the train records in `<workdir>/metrics.jsonl`."""
  recs = [
    json.loads(line) for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()
  ]
  return {r["step"]: r["loss"] for r in recs if r["split"] == "train"}


def saved_params(workdir, step):
  state, _ = ckpt.restore(ckpt.checkpoint_dir(workdir) / str(step))
  return state["params"]


def assert_trees_equal(a, b):
  la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


class Compilations:
  """Counts the XLA compilations of jitted functions named `name` (None: of any) while in the
  `with` block (JAX's public monitoring events; a persistent-cache hit still counts).
  `event=TRACED` counts their tracings instead (`name` is then the function's own name, 'f', not
  'jit(f)')."""

  EVENT = "/jax/core/compile/backend_compile_duration"
  TRACED = "/jax/core/compile/jaxpr_trace_duration"

  def __init__(self, name: str | None, event: str = EVENT):
    self.name, self.event, self.count = name, event, 0

  def _listen(self, event, duration, **kwargs):
    if event == self.event and self.name in (None, kwargs.get("fun_name")):
      self.count += 1

  def __enter__(self):
    jax.monitoring.register_event_duration_secs_listener(self._listen)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self._listen)


# ----------------------------------------------------------------------------- command lines
def cpu_env(devices: int = 1, **extra) -> dict:
  """This environment for a command line in a subprocess: JAX on `devices` simulated CPU devices
  (one compiles faster than conftest's 8), conftest's other XLA flags (unoptimized compiling) and
  the session's compilation cache kept; `extra`: variables to set."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", **extra)
  xla = [f for f in env.pop("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
  if devices > 1:
    xla.append(f"--xla_force_host_platform_device_count={devices}")
  if xla:
    env["XLA_FLAGS"] = " ".join(xla)
  return env


def one_device_env(**extra) -> dict:
  return cpu_env(1, **extra)


def free_port() -> int:
  """A TCP port of 127.0.0.1 free now (the system's pick: two pytest workers never share one)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


# train.py's flags of the multi-process jobs (tests/test_multihost.py, test_process_loss.py).
JOB_ARGS = [
  "--config=configs/tiny.py",
  "--config.num_train_steps=5",
  "--config.log_every_steps=1",
  "--config.eval.bleu_sentences=0",
  "--config.model.num_layers=1",
  "--config.model.d_model=32",
  "--config.model.d_ff=64",
  "--config.data.tokens_per_batch=256",
  "--config.data.max_len=16",
  "--config.data.synthetic_max_len=6",
  "--config.data.synthetic_num_train=2000",  # 5-10 steps read a few hundred
  "--config.eval.num_batches=1",
  "--config.checkpoint.async_save=false",
]


def run_py(*args, stdin=None, env=None, timeout=600, text=True) -> subprocess.CompletedProcess:
  """`python *args` from the repository root, as a user runs it (`one_device_env()` unless `env`
  is given); stdout and stderr captured."""
  return subprocess.run(
    [sys.executable, *map(str, args)],
    cwd=REPO,
    input=stdin,
    capture_output=True,
    text=text,
    env=one_device_env() if env is None else env,
    timeout=timeout,
  )


@dataclasses.dataclass
class Ran:
  """What `run_in_process` saw: the exit status and what was written to stdout and stderr."""

  returncode: int
  stdout: str
  stderr: str


absl_app.define_help_flags()  # as the first absl app.run would: --help stays defined throughout
_ABSL_FLAGS = set(flags.FLAGS)  # absl's own (logging, app, help): kept across runs


# The JAX options a command sets for its persistent compilation cache, put back after it ran.
JAX_CACHE_OPTIONS = (
  "jax_compilation_cache_dir",
  "jax_enable_compilation_cache",
  "jax_persistent_cache_min_compile_time_secs",
  "jax_persistent_cache_min_entry_size_bytes",
)


def run_in_process(script: str, *args: str, stdin: str | bytes = "") -> Ran:
  """Runs `python <script> <args>` in this process: `script` (train.py, decode.py, bench.py, or
  a `-m` module such as cli.average) runs its `__main__` block, so its own flags and the
  command-line runner (cli/app.py: parsing, one-line errors, exit status), without a new
  interpreter's seconds of imports. For the checks made before any work; the real command lines
  are run end to end in subprocesses too. Leaves the flags, the logging setup, absl's verbosity,
  JAX's cache settings and the garbage collector (decode.py freezes what its imports made) as
  they were, and the process's malloc settings alone; a command line that would end its process
  once done (`skip_teardown`) returns here instead."""
  from cli import app as cli_app
  from cli import host_memory

  others = {  # e.g. flags an entry point defined when imported for its functions: they'd clash
    name: flag
    for name, flag in flags.FLAGS._flags().items()
    if name not in _ABSL_FLAGS and _defined_by_a_command_line(name)
  }
  for name in others:
    delattr(flags.FLAGS, name)
  root, absl_logger = logging.getLogger(), logging.getLogger("absl")
  handler = absl_logging.get_absl_handler()
  saved_logging = (root.handlers[:], root.level, absl_logger.level, absl_logger.filters[:])
  saved_handler_filters, saved_stream = handler.filters[:], handler.python_handler.stream
  saved_jax = {name: getattr(jax.config, name) for name in JAX_CACHE_OPTIONS}
  saved_keep, saved_exit = host_memory.keep_freed_memory_on_cpu, cli_app.exit_now
  saved_rename = command_name.make_process_name_useful
  saved_argv, saved_stdin = sys.argv, sys.stdin
  collecting = gc.isenabled()
  out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", write_through=True)  # with .buffer
  err = io.StringIO()
  status = 0
  try:
    host_memory.keep_freed_memory_on_cpu = lambda *a, **k: host_memory.DEFAULT
    cli_app.exit_now = sys.exit  # this process goes on
    handler.python_handler.stream = err  # the run's log lines, as its stderr
    # absl.app initializes once per process (its handler on the root logger, verbosity INFO
    # unless given): as a new process does, for each run.
    absl_app._run_init.done = absl_app._register_and_parse_flags_with_usage.done = False
    command_name.make_process_name_useful = lambda: None  # this process keeps its name
    sys.argv = [script, *args]
    data = stdin.encode() if isinstance(stdin, str) else stdin
    sys.stdin = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8")
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
      if script.endswith(".py"):
        runpy.run_path(str(REPO / script), run_name="__main__")
      else:
        runpy.run_module(script, run_name="__main__", alter_sys=True)
  except SystemExit as e:
    status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
  finally:
    gc.unfreeze()
    (gc.enable if collecting else gc.disable)()
    host_memory.keep_freed_memory_on_cpu, cli_app.exit_now = saved_keep, saved_exit
    absl_app._run_init.done = absl_app._register_and_parse_flags_with_usage.done = True
    command_name.make_process_name_useful = saved_rename
    sys.argv, sys.stdin = saved_argv, saved_stdin
    for name in set(flags.FLAGS) - _ABSL_FLAGS:
      if _defined_by_a_command_line(name):  # a library's own flags, defined on import, stay
        delattr(flags.FLAGS, name)
    flags.FLAGS.unparse_flags()
    for name, flag in others.items():
      flags.FLAGS[name] = flag
    root.handlers[:], absl_logger.filters[:] = saved_logging[0], saved_logging[3]
    root.setLevel(saved_logging[1])
    absl_logger.setLevel(saved_logging[2])
    handler.filters[:] = saved_handler_filters
    handler.python_handler.stream = saved_stream
    for name, value in saved_jax.items():
      jax.config.update(name, value)
  out.flush()
  return Ran(status, out.buffer.getvalue().decode("utf-8"), err.getvalue())


def _defined_by_a_command_line(flag: str) -> bool:
  """Whether `flag` was defined by a command line (its `__main__` block or this repository's
  cli/, or the `--config.<field>` overrides absl and ml_collections define while parsing) rather
  than by a library module on import (e.g. TFDS's), which is imported only once."""
  name = flags.FLAGS.find_module_defining_flag(flag) or ""
  module = sys.modules.get(name)
  where = getattr(module, "__file__", None) or ""
  return (
    module is None or where.startswith(str(REPO)) or name.startswith(("ml_collections", "absl."))
  )
