"""Test setup: eight simulated CPU devices, set before JAX is imported anywhere."""

import os

# XLA:CPU compiles unoptimized (LLVM -O0, fusions by the older elemental emitters): the tests
# check results, not speed, and compiling is most of the suite's time (the two flags cut a
# compile-bound file's CPU time by half or more), each module emitted as one piece (no split for
# a parallel LLVM codegen that two busy cores cannot use).
# Subprocesses keep them (tests/helpers.py cpu_env).
os.environ.setdefault(
  "XLA_FLAGS",
  "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
  " --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1",
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Compile each distinct step once per test session, also across the train.py / decode.py
# subprocesses the tests start (they inherit this environment): XLA compile time dominates.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  import atexit
  import shutil
  import tempfile

  _cache = tempfile.mkdtemp(prefix="jax-test-cache-")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)  # each session's cache is its own
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import pytest  # noqa: E402

from tests.helpers import (  # noqa: E402
  DECODE_TRAIN_FLAGS,
  LONGER,
  MODEL_TYPES,
  SHARED,
  run_in_process,
  tiny_config,
  train_run,
)


@pytest.fixture(scope="session")
def shared_data():
  """Path to ../shared/data; skips the test when the folder is absent (a user's clone)."""
  path = SHARED / "data"
  if not path.is_dir():
    pytest.skip(f"needs the shared corpora in {path} (present in CI, absent in a user's clone)")
  return path


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
  """(config, workdir) of a tiny run trained for 12 steps with dropout, a checkpoint every 4:
  the reference that resumed, restored and averaged runs are compared with. Tests copy the
  workdir before changing anything in it."""
  workdir = tmp_path_factory.mktemp("full")
  config = tiny_config(
    num_devices=1,
    num_train_steps=12,
    log_every_steps=1,
    checkpoint_every_steps=4,
    **{"model.dropout_rate": 0.1},
  )
  train_run(config, workdir)
  return config, workdir


def _train_py(workdir, flags):
  """train.py with `flags`, run in this process (tests/helpers.py run_in_process)."""
  out = run_in_process("train.py", f"--workdir={workdir}", *flags)
  assert out.returncode == 0, out.stderr[-3000:]
  return workdir


@pytest.fixture(scope="session")
def decode_workdir(tmp_path_factory):
  """A tiny Transformer trained by train.py for 4 steps, checkpoints at steps 2 and 4."""
  return _train_py(tmp_path_factory.mktemp("decode") / "run", DECODE_TRAIN_FLAGS)


@pytest.fixture(scope="session")
def model_type_workdirs(tmp_path_factory):
  """{model.type: workdir} of each MODEL_TYPES trained by train.py for 150 steps, model.max_len
  24 (one checkpoint, at step 150)."""
  flags = [
    f"{f.split('=')[0]}={LONGER.get(f.split('=')[0], f.split('=')[1])}" for f in DECODE_TRAIN_FLAGS
  ]
  return {
    kind: _train_py(tmp_path_factory.mktemp(kind) / "run", [*flags, f"--config.model.type={kind}"])
    for kind in MODEL_TYPES
  }


# `pytest -m "not slow"`: the tier for iterating. Slow tests (real command-line processes: train.py,
# decode.py, bench.py runs, multi-process jobs, faults and signals; trained workdirs: the fixtures
# above; or 4 s or more each on 2 cores) are marked where they are written: `@pytest.mark.slow`,
# or a module's `pytestmark`.


# `pytest -n 2` (pytest-xdist; pyproject.toml: --dist=loadfile --no-loadscope-reorder) hands each
# worker whole files, in the order of the collection: the files that keep a worker longest go
# first, longest first, so that the two workers end together; the others follow by name. A file
# stays on one worker: its module and session fixtures and its in-memory compilations are made
# once there.
LONGEST_FIRST = [
  "test_translator.py",
  "test_process_loss.py",
  "test_multihost.py",
  "test_ctranslate2.py",
  "test_marian.py",
  "test_decode.py",
  "test_models_extra.py",
  "test_checkpoint.py",
  "test_training.py",
  "test_continuous.py",
  "test_faults.py",
  "test_scoring.py",
  "test_generate.py",
  "test_prefix.py",
  "test_bench.py",
  "test_preemption.py",
  "test_model.py",
]


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order
