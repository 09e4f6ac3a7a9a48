"""What a person at a terminal sees: numbers formatted for reading, and a one-line progress bar.

fmt(0.123456) -> '0.1235'
progress = Progress(total=1000, start=0, unit="steps")
progress.update(done, loss=..., rate=...)
"""

from __future__ import annotations

import sys
import time


def fmt(value) -> str:
  """A value as printed: floats to 4 significant digits, None as null."""
  if isinstance(value, float):
    return f"{value:.4g}"
  return "null" if value is None else str(value)


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
