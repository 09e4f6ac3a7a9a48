"""Where metrics go: stdout (absl logging), `<workdir>/metrics.jsonl`, TensorBoard event files,
and a progress bar on a terminal. Only process 0 writes; other processes get a silent writer."""

from __future__ import annotations

import json
import math
import os
import pathlib
import sys
import time

from absl import logging


def _plain(value):
  try:
    value = float(value)
  except (TypeError, ValueError):
    return value
  return value if math.isfinite(value) else None if math.isnan(value) else value


class MetricsWriter:
  """Writes one record per call: `{"step": s, "split": "train"|"eval", <metric>: value, ...}`
  as a JSON line, TensorBoard scalars (`<split>/<metric>`) and a log line. A disabled writer
  (processes other than 0) writes no file and logs only the loss."""

  def __init__(self, workdir: str | os.PathLike, enabled: bool = True, tensorboard: bool = True):
    self.enabled = enabled
    self._jsonl = None
    self._tb = None
    if not enabled:
      return
    workdir = pathlib.Path(workdir)
    self._jsonl = open(workdir / "metrics.jsonl", "a", encoding="utf-8")
    if tensorboard:
      from tensorboardX import SummaryWriter

      self._tb = SummaryWriter(str(workdir / "tensorboard"))

  def write(self, step: int, split: str, metrics: dict) -> None:
    if not self.enabled:  # other processes only log the line (useful to compare processes)
      logging.info("[%s] step %d: loss=%s", split, step, _fmt(_plain(metrics.get("loss"))))
      return
    record = {"step": int(step), "split": split}
    record.update({k: _plain(v) for k, v in metrics.items()})
    self._jsonl.write(json.dumps(record) + "\n")
    self._jsonl.flush()
    if self._tb is not None:
      for k, v in record.items():
        if k not in ("step", "split") and isinstance(v, (int, float)):
          self._tb.add_scalar(f"{split}/{k}", v, int(step))
      self._tb.flush()
    shown = " ".join(f"{k}={_fmt(v)}" for k, v in record.items() if k not in ("step", "split"))
    logging.info("[%s] step %d: %s", split, step, shown)

  def close(self) -> None:
    if self._jsonl:
      self._jsonl.close()
    if self._tb:
      self._tb.close()


def _fmt(v):
  if isinstance(v, float):
    return f"{v:.4g}"
  return str(v)


class Progress:
  """A one-line progress bar (step, loss, tokens/s, ETA) when stderr is a terminal; nothing
  otherwise (the periodic log lines carry the same numbers)."""

  def __init__(self, total_steps: int, start_step: int, enabled: bool = True):
    self.total, self.start = total_steps, start_step
    self.enabled = enabled and sys.stderr.isatty()
    self.t0 = time.time()

  def update(self, step: int, loss: float | None = None, tokens_per_s: float | None = None):
    if not self.enabled:
      return
    done = max(step - self.start, 1)
    elapsed = time.time() - self.t0
    eta = elapsed / done * (self.total - step)
    width = 30
    filled = int(width * step / max(self.total, 1))
    bar = "#" * filled + "-" * (width - filled)
    parts = [f"[{bar}] {step}/{self.total}"]
    if loss is not None:
      parts.append(f"loss {loss:.3f}")
    if tokens_per_s is not None:
      parts.append(f"{tokens_per_s:,.0f} tok/s")
    parts.append(f"ETA {int(eta // 60)}:{int(eta % 60):02d}")
    sys.stderr.write("\r" + "  ".join(parts) + "\033[K")
    sys.stderr.flush()

  def close(self):
    if self.enabled:
      sys.stderr.write("\n")


class _DropLibraryInfo:
  """Filters INFO-level chatter from libraries (Orbax logs every file it renames)."""

  def __init__(self, prefixes=("orbax", "tensorflow_datasets", "jax")):
    self.prefixes = prefixes

  def filter(self, record) -> bool:
    if record.levelno > 20:
      return True
    return not any(f"/{p}/" in record.pathname for p in self.prefixes)


def quiet_library_logs() -> None:
  """Keeps this project's INFO lines and library warnings; drops library INFO lines."""
  import logging as std_logging

  std_logging.getLogger("absl").addFilter(_DropLibraryInfo())
