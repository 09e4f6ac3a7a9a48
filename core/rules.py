"""What a value may be: the one definition of the checks on the model's hyperparameters
(model/config.py), on config fields (configs/common.py) and on command-line flags
(cli/app.py `check_flag`), so that a number out of its range, NaN or an infinity is refused the
same way everywhere, with an error naming the field or flag and the value.

    Int(min=1)                   an integer >= 1
    Float(min=0.0, below=1.0)    a finite number in [0, 1)
    Choice("pmap", "mesh")
    Bool(), Text()
    allowing(Int(min=1), 0)      the rule, or one more value (an integer >= 1 or 0)
"""

from __future__ import annotations

import dataclasses
import math
import numbers


class RuleError(ValueError):
  """A value that breaks its rule; the message says what it must be."""


@dataclasses.dataclass(frozen=True)
class Int:
  """An integer (numpy's too; booleans are not integers here) in [min, max]; `also` lists extra
  allowed values outside that range (e.g. -1 = 'the remaining devices')."""

  min: int | None = None
  max: int | None = None
  also: tuple[int, ...] = ()

  def check(self, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
      raise RuleError(f"must be an integer, not {type(value).__name__}")
    if value in self.also:
      return
    if (self.min is not None and value < self.min) or (self.max is not None and value > self.max):
      raise RuleError(f"must be {self.describe()}")

  def describe(self) -> str:
    if self.min is not None and self.max is not None:
      text = f"in [{self.min}, {self.max}]"
    elif self.min is not None:
      text = f">= {self.min}"
    elif self.max is not None:
      text = f"<= {self.max}"
    else:
      text = "an integer"
    return text + "".join(f" or {v}" for v in self.also)


@dataclasses.dataclass(frozen=True)
class Float:
  """A finite number (NaN and infinities refused) >= min (or > min with `above`) and <= max (or
  < max with `below`). Integers are accepted as numbers."""

  min: float | None = None
  max: float | None = None
  above: float | None = None
  below: float | None = None

  def check(self, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
      raise RuleError(f"must be a number, not {type(value).__name__}")
    if not math.isfinite(value):
      raise RuleError("must be a finite number" + (f" {self.describe()}" if self._bounded else ""))
    if (
      (self.min is not None and value < self.min)
      or (self.above is not None and value <= self.above)
      or (self.max is not None and value > self.max)
      or (self.below is not None and value >= self.below)
    ):
      raise RuleError(f"must be {self.describe()}")

  @property
  def _bounded(self) -> bool:
    return any(b is not None for b in (self.min, self.max, self.above, self.below))

  def describe(self) -> str:
    low = self.min if self.min is not None else self.above
    high = self.max if self.max is not None else self.below
    if low is not None and high is not None:
      left, right = "[" if self.min is not None else "(", "]" if self.max is not None else ")"
      return f"in {left}{low:g}, {high:g}{right}"
    if low is not None:
      return f"{'>=' if self.min is not None else '>'} {low:g}"
    if high is not None:
      return f"{'<=' if self.max is not None else '<'} {high:g}"
    return "a finite number"


@dataclasses.dataclass(frozen=True)
class Choice:
  options: tuple[str, ...]

  def __init__(self, *options: str):
    object.__setattr__(self, "options", tuple(options))

  def check(self, value) -> None:
    if value not in self.options:
      raise RuleError(f"must be one of {', '.join(map(repr, self.options))}")

  def describe(self) -> str:
    return "one of " + ", ".join(self.options)


@dataclasses.dataclass(frozen=True)
class Bool:
  def check(self, value) -> None:
    if not isinstance(value, bool):
      raise RuleError(f"must be true or false, got {type(value).__name__}")

  def describe(self) -> str:
    return "true or false"


@dataclasses.dataclass(frozen=True)
class Text:
  def check(self, value) -> None:
    if not isinstance(value, str):
      raise RuleError(f"must be a string, got {type(value).__name__}")

  def describe(self) -> str:
    return "a string"


Rule = Int | Float | Choice | Bool | Text


def allowing(rule: Rule, *values) -> Rule:
  """`rule` that also takes `values` (an Int's `also`, a Choice's options): a config's values that
  stand for one resolved later (model.vocab_size=0, model.dtype='auto')."""
  if isinstance(rule, Int):
    for value in values:
      if rule.min is not None and value == rule.min - 1:  # Int(min=1) and 0: Int(min=0)
        rule = dataclasses.replace(rule, min=value)
      else:
        rule = dataclasses.replace(rule, also=(*rule.also, value))
    return rule
  if isinstance(rule, Choice):
    return Choice(*rule.options, *values)
  raise TypeError(f"allowing: {type(rule).__name__} takes no extra values")
