"""Compiled decoding programs kept on disk, so that a second run of the same model and settings
neither traces, lowers nor compiles: it reads each program back, where JAX's persistent
compilation cache still traces and lowers the search first to find its key (docs/experiments.md,
"Compiled searches kept on disk", has the times).

    store = ProgramStore(folder)                       # inference.Translator makes one
    store.read_ahead(key)          # the programs the last run under `key` asked for, in the back
    generator = Generator(model, programs=store)       # inference/generator.py asks it per program
    compiled = store(signature, lambda: jitted.lower(*args))   # read back, or lowered + compiled
    store.finish()                 # the reading ahead stopped, the programs asked for recorded

A program's file is named by a digest of its signature (the model's hyperparameters, the search
settings but those a beam search takes as arguments, its alpha and stopping rule, and those a
file's search cuts on the host, its n-best and scores; every argument's shape, dtype and
sharding; `Generator` writes it) and of what else decides the compiled code: the source of
the `model` package (the traced functions), the JAX and jaxlib versions, the backend, the device
kind, the CPU (its model and instruction-set flags: a program compiled for one CPU may not run on
another), `XLA_FLAGS` and the JAX options that change lowering. So a changed model, code base,
library or machine gets a new file, never an old program. Parameters are arguments, never
constants, so a retrained model of the same shape reuses its programs. A file that cannot be
read back (cut short, or from another build) is compiled again and replaced, with a warning; a
folder that cannot be written to decodes anyway, with one warning. Deleting the folder at any
time is safe; nothing evicts old files. The files are pickles, as JAX's own serialized
executables are: keep the folder where only you can write. The time spent reading programs is
reported as the JAX monitoring event `LOAD_EVENT` (inference/phases.py counts it as "compile or
load").

Which programs a run needs follows from its input's lengths, known only once the input is read;
reading one back takes a while (it is linked into memory). So a run under a key
(inference/restore.py uses the workdir and checkpoint) starts reading back, in a background
thread, the programs the last run under the same key asked for, in that order, while it restores
its parameters and reads its input; `finish()` records the ones this run asked for (a `.recent`
file per key) and stops any reading still to come, as does the first program asked for that the
last run did not ask for (another input). A program read ahead is the same file a run would
read; one that is not asked for costs only the background thread's time.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import os
import pathlib
import pickle
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import jax
import jaxlib
import numpy as np
from absl import logging
from jax.experimental import serialize_executable

from core.cpu import cpuinfo

LOAD_EVENT = "/attention_jax/decode/program_load_duration"
SUFFIX = ".program"
RECENT = ".recent"  # a key's programs asked for in its last run, one file name a line
MAX_AHEAD = 16  # programs read ahead at most
_JAX_CACHE_HIT = "/jax/compilation_cache/cache_hits"
# JAX options that change how a traced function is lowered.
_LOWERING_OPTIONS = (
  "jax_enable_x64",
  "jax_default_matmul_precision",
  "jax_numpy_rank_promotion",
  "jax_numpy_dtype_promotion",
)


@functools.lru_cache(maxsize=1)
def _source_digest() -> str:
  """sha256 of the `model` package's Python files (names and contents), the code a program is
  traced from."""
  import model

  root = pathlib.Path(model.__file__).parent
  digest = hashlib.sha256()
  for path in sorted(root.rglob("*.py")):
    digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
  return digest.hexdigest()


def _cpu() -> str:
  """The host CPU's model name and instruction-set flags (Linux), else the platform's name."""
  info = cpuinfo()
  if not info:
    import platform

    return f"{platform.machine()} {platform.processor()}"
  return f"{info.get('model name', '')} | {info.get('flags', info.get('Features', ''))}"


def environment() -> str:
  """Everything besides a program's signature that decides its compiled code (module docstring)."""
  device = jax.devices()[0]
  options = {name: getattr(jax.config, name, None) for name in _LOWERING_OPTIONS}
  return "\n".join(
    [
      f"python {sys.version_info[:2]}, jax {jax.__version__}, jaxlib {jaxlib.__version__}",
      f"backend {device.platform} {device.client.platform_version}, {device.device_kind}",
      f"cpu {_cpu()}",
      f"XLA_FLAGS {os.environ.get('XLA_FLAGS', '')}",
      f"options {sorted(options.items())}",
      f"model source {_source_digest()}",
    ]
  )


def _compile(lower: Callable[[], jax.stages.Lowered]) -> tuple[jax.stages.Compiled, bool]:
  """(`lower().compile()`, whether JAX's persistent cache answered). JAX's cache does not keep
  this compilation: an executable read back from it serializes without its machine code (on
  XLA:CPU, JAX 0.10: "Function ... not found" when the copy runs), so only a program compiled
  here is written to the store, and none is left in JAX's cache to answer next time."""
  hits, here = [], threading.get_ident()

  def listen(event: str, **kwargs) -> None:  # JAX looks its cache up in the compiling thread
    if event == _JAX_CACHE_HIT and threading.get_ident() == here:
      hits.append(event)

  jax.monitoring.register_event_listener(listen)
  _no_jax_cache_writes(+1)
  try:
    return lower().compile(), bool(hits)
  finally:
    _no_jax_cache_writes(-1)
    jax.monitoring.unregister_event_listener(listen)


_WRITES = threading.Lock()
_writers_off = [0, None]  # compilations in progress here, the option's value before the first


def _no_jax_cache_writes(change: int) -> None:
  """Counts compilations in progress here (+1 / -1, from any thread): while there are some, JAX's
  persistent cache writes nothing (its minimum compile time is infinite); after the last, the
  option is as it was."""
  option = "jax_persistent_cache_min_compile_time_secs"
  with _WRITES:
    if change > 0 and _writers_off[0] == 0:
      _writers_off[1] = getattr(jax.config, option)
      jax.config.update(option, float("inf"))
    _writers_off[0] += change
    if _writers_off[0] == 0:
      jax.config.update(option, _writers_off[1])


def _inputs(compiled: jax.stages.Compiled) -> str:
  """The shapes of a program's int32 and int64 arguments (the batch's token ids), for the log:
  not the parameters' int8 weights or a bfloat16 table's uint16 bits (model/output_table.py)."""
  shapes = [
    f"{x.dtype}[{','.join(map(str, x.shape))}]"
    for x in jax.tree_util.tree_leaves(compiled.args_info)
    if x.shape and x.dtype in (np.int32, np.int64)
  ]
  return ", ".join(shapes) or "scalar arguments"


class KeptFolder:
  """A folder of files kept between runs (this store's programs, inference/params_copy.py's
  parameter copies): `write(path, fill)` writes a file whole or not at all; a failure warns once
  (`what` the files are, `lost`: what the next run does without them) and decoding goes on."""

  def __init__(self, folder, what: str, lost: str):
    self.folder = pathlib.Path(folder)
    self.what, self.lost = what, lost
    self.writable = True

  def write(self, path: pathlib.Path, fill: Callable) -> bool:
    """`fill(file)` writes the content into a temporary file of the folder, renamed to `path`
    when whole (a reader sees the whole file or none); whether it was written."""
    if not self.writable:
      return False
    tmp = None
    try:
      self.folder.mkdir(parents=True, exist_ok=True)
      fd, tmp = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
      with os.fdopen(fd, "wb") as f:
        fill(f)
      os.replace(tmp, path)
      return True
    except Exception as e:  # an unwritable folder, or content that cannot be serialized
      self.writable = False
      logging.warning("%s are not kept in %s (%s): %s", self.what, self.folder, e, self.lost)
      if tmp is not None and os.path.exists(tmp):
        os.unlink(tmp)
      return False


class ProgramStore:
  """A folder of compiled programs: `store(signature, lower)` returns the program of `signature`,
  read from the folder when there, else `lower().compile()`, written to the folder for the next
  run. Counts: `loaded` (read back) and `compiled`."""

  def __init__(self, folder):
    self.folder = pathlib.Path(folder)
    self.loaded = 0
    self.compiled = 0
    self.read_early = 0  # of `loaded`: those read ahead
    self._kept = KeptFolder(folder, "Compiled programs", "the next run compiles them again")
    self._asked: list[str] = []  # file names, in the order this run first asked for them
    self._asked_lock = threading.Lock()
    self._recorded: set[pathlib.Path] = set()  # the programs the key's last run asked for
    self._ahead: dict[pathlib.Path, concurrent.futures.Future] = {}
    self._reader: threading.Thread | None = None
    self._recent: pathlib.Path | None = None

  def path(self, signature: str) -> pathlib.Path:
    """The file of the program with `signature` in this environment."""
    key = hashlib.sha256(f"{environment()}\n{signature}".encode()).hexdigest()
    return self.folder / f"{key[:40]}{SUFFIX}"

  def read_ahead(self, key: str) -> None:
    """Starts reading back, in a background thread, the programs the last run under `key` asked
    for (`finish` recorded them), in that order, on JAX's first device; `finish()` stops it.
    Nothing to read (no record, or files gone) is no error."""
    self._recent = self.path(f"read ahead\n{key}").with_suffix(RECENT)
    try:
      names = self._recent.read_text().split()
    except (OSError, UnicodeDecodeError):
      names = []
    paths = [self.folder / n for n in names if n.endswith(SUFFIX) and "/" not in n]
    self._recorded = set(paths)
    self._ahead = {p: concurrent.futures.Future() for p in paths[:MAX_AHEAD] if p.exists()}
    if not self._ahead:
      return
    device = jax.devices()[0]

    def read() -> None:
      for path, future in self._ahead.items():
        if future.set_running_or_notify_cancel():  # not cancelled by `finish` or an asker
          try:
            future.set_result(self._read(path, device))
          except BaseException as e:  # the asker reads or compiles it itself
            future.set_exception(e)

    self._reader = threading.Thread(target=read, name="programs read ahead")
    self._reader.start()

  def finish(self) -> None:
    """Stops reading ahead (a program being read is finished) and records the programs this run
    asked for under `read_ahead`'s key, for the next run to read ahead."""
    for future in self._ahead.values():
      future.cancel()
    if self._reader is not None:
      self._reader.join()
    with self._asked_lock:
      asked = list(self._asked)
    if self._recent is not None and asked:
      self._kept.write(self._recent, lambda f: f.write("\n".join(asked).encode() + b"\n"))

  def _read(self, path: pathlib.Path, device) -> jax.stages.Compiled:
    """The program in the file `path`, loaded onto `device`."""
    with path.open("rb") as f:
      serialized, in_tree, out_tree = pickle.load(f)
    return serialize_executable.deserialize_and_load(
      serialized, in_tree, out_tree, execution_devices=[device]
    )

  def _early(self, path: pathlib.Path, device) -> jax.stages.Compiled | None:
    """`path`'s program if it is read ahead for `device` (waiting for a read in progress); None
    if it is not, nor being read (it is then taken off the reader's list). A program the last run
    did not ask for says this run's input differs: nothing more is read ahead."""
    if path not in self._recorded:
      for other in self._ahead.values():
        other.cancel()
      return None
    future = self._ahead.get(path)
    if future is None or future.cancel() or device != jax.devices()[0]:
      return None
    try:
      return future.result()
    except Exception:  # read again below, where a failure is reported
      return None

  def __call__(
    self, signature: str, lower: Callable[[], jax.stages.Lowered], device=None, what=None
  ) -> jax.stages.Compiled:
    """The compiled program of `signature`. `lower` makes its `jax.stages.Lowered` when it is not
    in the folder; `device`: the one device it runs on (default: JAX's first); `what`: the
    program for the log (default: its integer arguments' shapes)."""
    device = device or jax.devices()[0]
    path = self.path(f"{signature}\n{device.platform} {device.device_kind}")
    with self._asked_lock:
      if path.name not in self._asked:
        self._asked.append(path.name)
    begin = time.perf_counter()
    compiled = self._early(path, device)
    early = compiled is not None
    self.read_early += early
    if not early and path.exists():
      try:
        compiled = self._read(path, device)
      except Exception as e:  # a file cut short, or written by another build: compile again
        logging.warning("Compiled program %s could not be read (%s); compiling it again", path, e)
    if compiled is not None:
      seconds = time.perf_counter() - begin
      jax.monitoring.record_event_duration_secs(LOAD_EVENT, seconds)
      self.loaded += 1
      how = " (read ahead)" if early else ""
      logging.vlog(
        1, "Program for %s read back in %.2f s%s", what or _inputs(compiled), seconds, how
      )
      return compiled
    begin = time.perf_counter()
    compiled, from_jax_cache = _compile(lower)
    self.compiled += 1
    logging.vlog(
      1,
      "Program for %s compiled in %.2f s%s",
      what or _inputs(compiled),
      time.perf_counter() - begin,
      " (from JAX's persistent cache)" if from_jax_cache else f", kept in {self.folder}",
    )
    if not from_jax_cache:
      self._write(path, compiled)
    return compiled

  def _write(self, path: pathlib.Path, compiled: jax.stages.Compiled) -> None:
    """Writes `compiled` to `path` (`KeptFolder.write`)."""
    self._kept.write(path, lambda f: pickle.dump(serialize_executable.serialize(compiled), f))
