"""The training loop behind train.py: data -> state (restored or new) -> steps -> eval ->
checkpoints. Importable without flags: `train(config, workdir)`."""

from __future__ import annotations

import functools
import json
import pathlib
import signal
import time

from absl import logging


class Stop(Exception):
  """A clear, expected error: printed as one line, exit status 1."""


def check_workdir(workdir: pathlib.Path) -> None:
  import tempfile

  try:
    workdir.mkdir(parents=True, exist_ok=True)
    # A probe of its own per process: with one shared name, processes of a multi-host job raced
    # (one deleted the file another was about to delete: FileNotFoundError, seen in CI).
    with tempfile.NamedTemporaryFile(dir=workdir, prefix=".write_test-"):
      pass
  except OSError as e:
    raise Stop(f"--workdir={workdir}: not writable ({e.strerror or e})") from None


class _Preemption:
  """Records SIGTERM/SIGINT so the loop can save and exit after the current step (with several
  processes: after the next step that is a multiple of MULTIHOST_EVERY). A second signal raises
  KeyboardInterrupt: no new save (one already in flight is finished), the last finished checkpoint
  stays as it was. `close()` puts the previous handlers back.

  Python runs signal handlers only between bytecodes of the main thread, so a process stuck in a
  C++ call (a collective another process never joins) would ignore both signals. A watchdog thread
  therefore hears every signal through `signal.set_wakeup_fd`, which the C-level handler writes to
  at once: if the process is still training `timeout_s` seconds after the first stop signal (at
  most 30 s after a second one), it writes a line to stderr and exits with status 128 + signal
  number, as the default action would. Checkpoint writes are atomic, so the last finished
  checkpoint survives. `timeout_s=0` disables the watchdog."""

  SECOND_SIGNAL_TIMEOUT_S = 30.0

  def __init__(self, timeout_s: float = 0.0):
    self.signal = None
    self._previous = {
      sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)
    }
    self._watchdog = None
    if timeout_s > 0:
      self._watchdog = _StopWatchdog(timeout_s, self.SECOND_SIGNAL_TIMEOUT_S)

  def _handle(self, signum, frame):
    del frame
    name = signal.Signals(signum).name
    if self.signal is not None:
      self.close()
      raise KeyboardInterrupt(f"second stop signal ({name}): stopped without saving")
    self.signal = name
    logging.warning(
      "%s received: saving and stopping after this step (send it again to stop without a new save)",
      name,
    )

  def close(self):
    if self._watchdog is not None:
      self._watchdog.close()
      self._watchdog = None
    for sig, handler in self._previous.items():
      if handler is not None:  # None: installed from C, cannot be put back from Python
        signal.signal(sig, handler)
    self._previous = {}

  # Several processes must agree to stop at the same step, which takes a collective that waits
  # for the queued steps; it runs every this many steps so that it does not stall each one.
  MULTIHOST_EVERY = 10

  def requested(self, step: int) -> bool:
    import jax

    if jax.process_count() == 1:
      return self.signal is not None
    if step % self.MULTIHOST_EVERY:
      return False
    import numpy as np
    from jax.experimental import multihost_utils

    flags_ = multihost_utils.process_allgather(np.int32(self.signal is not None))
    return bool(np.max(flags_))


class _StopWatchdog:
  """The thread behind `_Preemption`'s timeout: reads signal numbers from a wakeup socket and
  ends the process with `os._exit` when a stop signal has gone unanswered for too long."""

  def __init__(self, timeout_s: float, second_timeout_s: float):
    import socket
    import threading

    self._timeout_s, self._second_timeout_s = timeout_s, second_timeout_s
    self._reader, self._writer = socket.socketpair()
    self._writer.setblocking(False)
    self._closed = threading.Event()
    self._previous_fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
    self._thread = threading.Thread(target=self._watch, name="stop-watchdog", daemon=True)
    self._thread.start()

  def _watch(self):
    import os

    stops, deadline, started, signum = (signal.SIGTERM, signal.SIGINT), None, 0.0, 0
    while True:
      self._reader.settimeout(None if deadline is None else max(0.0, deadline - time.monotonic()))
      try:
        data = self._reader.recv(64)
      except TimeoutError:
        data = None
      except OSError:
        return
      if self._closed.is_set() or data == b"":
        return
      if data is None:
        name = signal.Signals(signum).name
        os.write(
          2,
          (
            f"{name} received {deadline - started:.0f} s ago and the process "
            f"has not stopped (stuck in a collective or a save?): exiting with status "
            f"{128 + signum} without a new checkpoint; the last finished one is "
            f"intact\n"
          ).encode(),
        )
        os._exit(128 + signum)
      for number in data:
        if number not in stops:
          continue
        now = time.monotonic()
        if deadline is None:
          started, deadline, signum = now, now + self._timeout_s, number
        else:
          deadline = min(deadline, now + self._second_timeout_s)

  def close(self):
    self._closed.set()
    signal.set_wakeup_fd(self._previous_fd)
    self._writer.close()  # wakes the thread: recv returns b""
    self._thread.join(timeout=5)
    self._reader.close()


def fit_model_vocab(config, vocab_size: int) -> None:
  """Sets model.vocab_size 0 to the vocabulary's `vocab_size`; a smaller one is a config error, a
  larger one a warning (the extra ids never occur, yet get logits and label-smoothing mass)."""
  with config.unlocked():
    if config.model.vocab_size <= 0:
      config.model.vocab_size = vocab_size
  if vocab_size > config.model.vocab_size:
    raise Stop(
      f"config error: model.vocab_size={config.model.vocab_size} is smaller than the "
      f"vocabulary ({vocab_size} ids)"
    )
  if vocab_size < config.model.vocab_size:
    logging.warning(
      "model.vocab_size=%d is larger than the vocabulary (%d ids): ids %d and up "
      "never occur but still get logits and label-smoothing mass; set "
      "model.vocab_size=0 to use the vocabulary's size",
      config.model.vocab_size,
      vocab_size,
      vocab_size,
    )


def build_steps(config):
  """The model and the train/eval steps wrapped for `config.parallelism`: (model, Parallel).
  train.py, bench.py and the tests all build the step here, so they time and test the same one."""
  from model.build import build_model
  from training import parallel as par
  from training import step as step_lib
  from training.state import init_state, make_optimizer

  if config.model.dtype == "float16":
    raise ValueError(
      "config error: model.dtype='float16' cannot train here: there is no loss "
      "scaling, so small gradients underflow to zero; use bfloat16"
    )
  smoothing = config.optim.label_smoothing
  if not 0.0 <= smoothing < 1.0:
    raise ValueError(f"config error: optim.label_smoothing={smoothing!r} must be in [0, 1)")
  model = build_model(config.model)
  cudnn = config.model.get("attention_impl") == "cudnn" and config.model.type in (
    "transformer",
    "decoder_only",
  )
  if cudnn and int(config.data.max_len) % 2:
    raise ValueError(
      f"config error: model.attention_impl='cudnn' needs an even data.max_len "
      f"(cuDNN's masked attention takes even lengths when training), got "
      f"{config.data.max_len}"
    )
  if cudnn and config.model.get("attention_dropout_rate"):
    logging.warning(
      "model.attention_impl='cudnn' with model.attention_dropout_rate=%g: training "
      "steps take the XLA attention path (cuDNN's kernel has no dropout here); eval "
      "and decoding use cuDNN",
      config.model.attention_dropout_rate,
    )
  tx, schedule = make_optimizer(config)
  train_step = functools.partial(
    step_lib.train_step,
    model=model,
    tx=tx,
    schedule=schedule,
    label_smoothing=config.optim.label_smoothing,
    grad_accum_steps=int(config.optim.grad_accum_steps),
  )
  eval_step = functools.partial(
    step_lib.eval_step, model=model, label_smoothing=config.optim.label_smoothing
  )
  parallel = par.build(
    config.parallelism,
    config,
    init_fn=lambda rng: init_state(model, tx, rng),
    train_step=train_step,
    eval_step=eval_step,
  )
  return model, parallel


def train(config, workdir: pathlib.Path) -> dict:
  """The whole run; returns the last eval metrics."""
  import jax

  from data import pipeline as data_pipeline
  from data import tokenizer
  from training import checkpoint as ckpt
  from training import evaluate
  from training import parallel as par
  from training.metrics import MetricsWriter, Progress, quiet_library_logs

  quiet_library_logs()
  lead = jax.process_index() == 0
  accum = int(config.optim.grad_accum_steps)
  if accum < 1:
    raise Stop(f"config error: optim.grad_accum_steps={accum} must be >= 1")
  for key in ("log_every_steps", "eval_every_steps", "checkpoint_every_steps"):
    if int(config[key]) < 1:
      raise Stop(
        f"config error: {key}={config[key]} must be >= 1 (to do it only at the end, "
        f"set it to num_train_steps)"
      )
  data_parallel = par.data_parallel_size(config)

  # Data. Process 0 trains/tokenizes first so the others reuse its vocabulary and cache.
  def build_data():
    return data_pipeline.build(
      config,
      workdir,
      batch_multiple=data_parallel * accum,
      process_index=jax.process_index(),
      process_count=jax.process_count(),
    )

  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    pipeline = build_data() if lead else None
    multihost_utils.sync_global_devices("data ready")
    pipeline = pipeline or build_data()
  else:
    pipeline = build_data()
  vocab = pipeline.vocab
  fit_model_vocab(config, vocab.vocab_size)
  logging.info(
    "train batch shapes %s: the step compiles at most %d time(s)",
    pipeline.batch_shapes,
    len(pipeline.batch_shapes),
  )

  model, parallel = build_steps(config)

  # State: resume or start.
  checkpointer = ckpt.Checkpointer(
    workdir,
    keep=config.checkpoint.keep,
    keep_best=config.checkpoint.keep_best,
    async_save=config.checkpoint.async_save,
  )
  train_iter = pipeline.train_iter()
  rng = jax.random.key(config.seed)

  def check_meta(meta):
    ckpt.check_compatible(ckpt.config_from_meta(meta), config)
    saved_vocab = meta.get("vocab")
    if saved_vocab is not None and saved_vocab != vocab.fingerprint:
      raise ValueError(
        f"the checkpoint in {checkpointer.root} was trained with vocabulary "
        f"{saved_vocab}, this run has {vocab.fingerprint} (data.vocab_path or the "
        f"workdir's vocabulary file changed): use a new workdir or the old vocabulary"
      )

  restored = checkpointer.restore_latest(
    _restore_target(parallel, config),
    check_meta=check_meta,
    explain=lambda meta: ckpt.config_differences(ckpt.config_from_meta(meta), config),
  )
  if restored is not None:
    step0, state, meta = restored
    state = parallel.place_state(state) if parallel.kind == "pmap" else state
    train_iter.restore(meta["data_state"])
    logging.info("resumed from %s at step %d", checkpointer.root / str(step0), step0)
    _log_changed_recipe(ckpt.config_from_meta(meta), config)
  else:
    state = parallel.init_state(jax.random.fold_in(rng, 1))
    step0 = 0
  if lead and config.data.vocab_path:  # the workdir alone must decode, here or elsewhere
    tokenizer.save_in_workdir(vocab, workdir)
  if step0 >= config.num_train_steps:
    checkpointer.close()
    logging.warning(
      "%s is already at step %d (num_train_steps=%d): nothing to train; raise "
      "num_train_steps to continue",
      checkpointer.root / str(step0),
      step0,
      config.num_train_steps,
    )
    return {}
  rng = jax.random.fold_in(rng, 2)

  writer = MetricsWriter(workdir, enabled=lead)
  progress = Progress(config.num_train_steps, step0, enabled=lead)
  if lead:
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))

  def meta():
    return {
      "config": config.to_json(),
      "data_state": train_iter.state(),
      "seed": config.seed,
      "step": step,
      "vocab": vocab.fingerprint,
    }

  saved_step = step0

  def save(step, metrics=None, force=False):
    nonlocal saved_step
    to_save = parallel.host_state(state) if parallel.kind == "pmap" else state
    if checkpointer.save(step, to_save, meta(), metrics=metrics, force=force):
      saved_step = step

  eval_pairs = pipeline.pairs(config.data.eval_split)
  bleu_pairs = eval_pairs[: config.eval.bleu_sentences] if config.eval.bleu_sentences else []
  eval_batches = pipeline.eval_batches()
  if config.eval.num_batches:
    eval_batches = eval_batches[: config.eval.num_batches]

  def run_eval(step):
    params = state.params
    metrics = evaluate.loss_metrics(parallel, params, eval_batches)
    if bleu_pairs:
      host_params = parallel.host_state(state).params if parallel.kind == "pmap" else params
      metrics.update(
        evaluate.translation_metrics(
          model,
          host_params,
          vocab,
          bleu_pairs,
          max_len=config.data.max_len,
          max_extra_len=config.eval.max_decode_extra,
        )
      )
    writer.write(step, "eval", metrics)
    return metrics

  step = step0
  last_eval, pending = {}, None
  window = None  # train metrics summed since the last log line (_accumulate)
  t_log, tokens_since = time.time(), 0.0
  t_start = time.time()
  preemption = _Preemption(config.stop_timeout_s)
  try:
    while step < config.num_train_steps:
      batch = next(train_iter)
      state, metrics = parallel.train_step(state, batch, rng)
      step += 1
      tokens_since += (
        float((batch["targets_segmentation"] > 0).sum() + (batch["inputs_segmentation"] > 0).sum())
        * jax.process_count()
      )
      # Check the previous step's counter now that this step is queued (no pipeline stall).
      if pending is not None and int(pending) >= config.optim.max_nonfinite_steps:
        raise Stop(
          f"training stopped at step {step - 1}: {int(pending)} consecutive steps had a "
          f"non-finite loss or gradient (optim.max_nonfinite_steps="
          f"{config.optim.max_nonfinite_steps}); lower optim.learning_rate or set "
          f"optim.clip_norm"
        )
      pending = metrics["nonfinite_streak"]
      window = _accumulate(window, metrics)
      if step % config.log_every_steps == 0 or step == config.num_train_steps:
        m = _window_means(jax.device_get(window), jax.device_get(metrics))
        now = time.time()
        m["tokens_per_s"] = tokens_since / max(now - t_log, 1e-9)
        m["steps_per_s"] = m.pop("steps") / max(now - t_log, 1e-9)
        writer.write(step, "train", m)
        progress.update(step, m["loss"], m["tokens_per_s"])
        t_log, tokens_since, window = now, 0.0, None
      else:
        progress.update(step)
      evaluated = step % config.eval_every_steps == 0 and step != config.num_train_steps
      if evaluated:
        last_eval = run_eval(step)
      if step % config.checkpoint_every_steps == 0 and step != config.num_train_steps:
        # Only this step's own BLEU ranks it for checkpoint.keep_best; an older score would not.
        save(step, {"bleu": last_eval["bleu"]} if evaluated and "bleu" in last_eval else None)
      if preemption.requested(step):
        if saved_step != step:  # the periodic save may just have written this step
          save(step, force=True)
        checkpointer.close()
        progress.close()
        logging.warning(
          "%s received: saved step %d to %s and stopped; re-run the same command to resume",
          preemption.signal or "stop signal",
          step,
          checkpointer.root / str(step),
        )
        return last_eval
    if int(jax.device_get(metrics["nonfinite_streak"])) >= config.optim.max_nonfinite_steps:
      raise Stop(f"training stopped at step {step}: too many consecutive non-finite steps")
    last_eval = run_eval(step)
    save(step, {"bleu": last_eval.get("bleu", 0.0)}, force=True)
  finally:
    preemption.close()
    checkpointer.close()
    progress.close()
    writer.close()
  elapsed = time.time() - t_start
  summary = {"step": step, "train_seconds": round(elapsed, 1), **last_eval}
  if lead:
    print(
      "final: "
      + json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in summary.items()}),
      flush=True,
    )
  return last_eval


def _log_changed_recipe(saved, config) -> None:
  """Resuming with other optimizer settings or step count is allowed; it is logged, since under a
  cosine schedule num_train_steps reshapes the rest of the decay."""
  from training import checkpoint as ckpt

  changed = ckpt.config_differences(
    saved, config, sections=("optim",), top_level=("num_train_steps",)
  )
  if changed:
    logging.warning(
      "resuming with a changed recipe: %s%s",
      changed,
      " (the cosine decay now ends at num_train_steps)"
      if config.optim.schedule == "cosine"
      else "",
    )


def _accumulate(window, metrics):
  """Adds one step's train metrics to the running sums of the log window (on device: no sync).
  Loss, nll and accuracy are weighted by the step's target tokens; skipped (non-finite) steps
  are counted but not summed."""
  return _accumulator()(window, metrics)


@functools.cache
def _accumulator():
  import jax
  import jax.numpy as jnp

  def add(window, metrics):
    ok = metrics["nonfinite"] == 0
    tokens = metrics["tokens"].astype(jnp.float32)
    weight = jnp.where(ok, tokens, 0.0)
    step = {
      "loss": jnp.where(ok, metrics["loss"], 0.0) * weight,
      "nll": jnp.where(ok, metrics["nll"], 0.0) * weight,
      "correct": jnp.where(ok, metrics["accuracy"], 0.0) * weight,
      "weight": weight,
      "tokens": tokens,
      "grad_norm": jnp.where(ok, metrics["grad_norm"], 0.0),
      "finite_steps": ok.astype(jnp.float32),
      "steps": jnp.float32(1.0),
      "nonfinite": metrics["nonfinite"].astype(jnp.float32),
    }
    return step if window is None else jax.tree_util.tree_map(jnp.add, window, step)

  return jax.jit(add)


def _window_means(window: dict, last: dict) -> dict:
  """The logged train record: token-weighted means of loss, nll and accuracy and the mean
  gradient norm over the window's finite steps (NaN when every step was skipped), mean target
  tokens per step, the number of skipped steps, and the last step's learning rate and streak."""
  nan = float("nan")
  weight, finite = float(window["weight"]), float(window["finite_steps"])
  steps = float(window["steps"])
  return {
    "loss": float(window["loss"]) / weight if weight else nan,
    "nll": float(window["nll"]) / weight if weight else nan,
    "accuracy": float(window["correct"]) / weight if weight else nan,
    "grad_norm": float(window["grad_norm"]) / finite if finite else nan,
    "tokens": float(window["tokens"]) / steps,
    "learning_rate": float(last["learning_rate"]),
    "nonfinite": float(window["nonfinite"]),
    "nonfinite_streak": float(last["nonfinite_streak"]),
    "steps": steps,
  }


def _restore_target(parallel, config):
  """Abstract state with the shardings this run uses (pmap: one device, replicated after)."""
  import jax

  from training import parallel as par

  if parallel.kind == "mesh":
    return jax.tree_util.tree_map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      parallel.abstract_state,
      parallel.state_sharding,
    )
  one = jax.sharding.SingleDeviceSharding(par.local_devices(config)[0])
  return jax.tree_util.tree_map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), parallel.abstract_state
  )
