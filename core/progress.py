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
  """A one-line progress bar on stderr when it is a terminal, nothing otherwise (logs and pipes
  stay clean): done/total, optional loss and tokens/s, the rate in `unit` per second, and the
  time left.

  `stream` replaces stderr (tests); `enabled=False` turns it off whatever the stream is."""

  def __init__(
    self, total: int, start: int = 0, unit: str = "steps", enabled: bool = True, stream=None
  ):
    self.total, self.start, self.unit = total, start, unit
    self.stream = stream if stream is not None else sys.stderr
    self.enabled = enabled and self.stream.isatty()
    self.t0 = time.time()
    self.shown = False

  def update(self, done: int, loss: float | None = None, tokens_per_s: float | None = None):
    if not self.enabled:
      return
    elapsed = max(time.time() - self.t0, 1e-9)
    rate = max(done - self.start, 0) / elapsed
    eta = (self.total - done) / rate if rate > 0 else 0.0
    width = 30
    filled = int(width * done / max(self.total, 1))
    bar = "#" * filled + "-" * (width - filled)
    parts = [f"[{bar}] {done}/{self.total}"]
    if loss is not None:
      parts.append(f"loss {loss:.3f}")
    if tokens_per_s is not None:
      parts.append(f"{tokens_per_s:,.0f} tok/s")
    parts.append(f"{rate:,.1f} {self.unit}/s")
    parts.append(f"ETA {int(eta // 60)}:{int(eta % 60):02d}")
    self.stream.write("\r" + "  ".join(parts) + "\033[K")
    self.stream.flush()
    self.shown = True

  def close(self):
    if self.enabled and self.shown:
      self.stream.write("\n")
      self.stream.flush()
