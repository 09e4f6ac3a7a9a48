"""How to search for a translation, as one immutable value.

    settings = SearchSettings(beam_size=5, alpha=1.0, length_penalty="fairseq")
    ids = Generator(model)(params, inputs, settings)   # inference/generator.py

The one spelling of the search options: `inference.generator` compiles one program per distinct
`settings.program()`, `inference.Translator` takes them as keyword options (`with_keywords`, the
one reading of "a SearchSettings or its fields as keywords"), and decode.py defines its flags
from the fields below (their names, defaults and help).
"""

from __future__ import annotations

import dataclasses
import math

# Beam search's length penalties, stopping rules and target-prefix rules (model/search.py).
PENALTIES = ("gnmt", "fairseq")
STOPPING = ("exact", "finished")  # when a sentence is done
PREFIX_RULES = ("forced", "ctranslate2")  # how a target prefix counts (model/search.py)

# Marian's search rule (model/marian_beam.py): its own beam, normalisation and length limit.
MARIAN = "marian"


def stopping_rule(penalty: str, stopping=None):
  """The stopping rule beam search follows: `stopping`, or with None the penalty's own, 'exact'
  for 'gnmt' (search on while a live hypothesis could still win) and 'finished' for 'fairseq'
  (done once `beam` hypotheses have finished, as fairseq and CTranslate2); a traced bool
  `stopping` (true: 'finished'; `SearchSettings.with_rule`) as it is."""
  if stopping is not None and not isinstance(stopping, str):
    return stopping
  if stopping is None:
    return "finished" if penalty == "fairseq" else "exact"
  if stopping not in STOPPING:
    raise ValueError(f"stopping={stopping!r}: must be one of {STOPPING}")
  return stopping


def check_prefix_rule(rule: str) -> str:
  """`rule` if it is one of PREFIX_RULES, else ValueError naming it."""
  if rule not in PREFIX_RULES:
    raise ValueError(f"prefix_rule={rule!r}: must be one of {PREFIX_RULES}")
  return rule


def _help(text: str) -> dict:
  return {"help": text}


@dataclasses.dataclass(frozen=True)
class SearchSettings:
  """Greedy search (`beam_size=1`), beam search, or sampling (`temperature > 0`).

  Beam search scores a hypothesis by its log-probability over a length penalty: 'gnmt' (the
  paper's ((5+len)/6)^alpha, searching on while a live hypothesis could still win) or 'fairseq'
  (len^alpha, a sentence done once `beam_size` hypotheses are, as fairseq and CTranslate2 search);
  `stopping` picks either rule for either penalty. A sentence's output has at most (its source
  tokens + `max_extra_len`) tokens, EOS included.
  """

  beam_size: int = dataclasses.field(default=4, metadata=_help("Beam size; 1 = greedy search."))
  alpha: float = dataclasses.field(
    default=0.6, metadata=_help("Length penalty exponent of beam search.")
  )
  length_penalty: str = dataclasses.field(
    default="gnmt",
    metadata=_help(
      "The length penalty's form: gnmt (the paper's ((5+len)/6)^alpha) or fairseq (len^alpha, a "
      "sentence done once beam_size hypotheses are, as fairseq and CTranslate2 search); marian: "
      "Marian's whole search rule (a beam that shrinks as hypotheses end, len^alpha, <unk> "
      "barred, at most 3x the source's tokens)."
    ),
  )
  max_extra_len: int = dataclasses.field(
    default=50, metadata=_help("Output length limit = source length + this.")
  )
  temperature: float = dataclasses.field(
    default=0.0, metadata=_help("> 0: sample instead of searching.")
  )
  top_k: int = dataclasses.field(
    default=0, metadata=_help("Sample from the k most likely tokens (0 = all).")
  )
  num_hypotheses: int = dataclasses.field(
    default=1, metadata=_help("How many of beam search's best hypotheses to return (<= beam).")
  )
  stopping: str | None = dataclasses.field(
    default=None,
    metadata=_help(
      "When beam search is done with a sentence: exact (once no live hypothesis can beat the "
      "finished ones) or finished (once beam_size hypotheses have finished); unset: the length "
      "penalty's own, exact for gnmt and finished for fairseq."
    ),
  )
  prefix_rule: str = dataclasses.field(
    default="forced",
    metadata=_help(
      "How a target prefix counts: forced (its tokens' log-probabilities in the scores, as "
      "forced decoding) or ctranslate2 (CTranslate2's target_prefix: they count 0, and beam "
      "search ends right after the prefix only where EOS is the best token)."
    ),
  )

  def __post_init__(self):
    for name, minimum in (
      ("beam_size", 1),
      ("max_extra_len", 0),
      ("top_k", 0),
      ("num_hypotheses", 1),
    ):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r}: must be an integer")
      if value < minimum:
        raise ValueError(f"{name}={value!r}: must be >= {minimum}")
    for name in ("alpha", "temperature"):
      value = getattr(self, name)
      number = isinstance(value, (int, float)) and not isinstance(value, bool)
      if not number or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}={value!r}: must be a finite number >= 0")
      object.__setattr__(self, name, float(value))
    if self.length_penalty not in (*PENALTIES, MARIAN):
      raise ValueError(
        f"length_penalty={self.length_penalty!r}: must be one of {(*PENALTIES, MARIAN)}"
      )
    if self.length_penalty == MARIAN and self.sampling:
      raise ValueError("length_penalty='marian' is a beam search: it does not sample")
    if self.length_penalty == MARIAN and self.stopping is not None:
      raise ValueError(
        f"stopping={self.stopping!r}: length_penalty='marian' has its own (a beam that shrinks "
        f"until no hypothesis is live); leave stopping unset"
      )
    if self.length_penalty == MARIAN and self.prefix_rule != "forced":
      raise ValueError(
        f"prefix_rule={self.prefix_rule!r}: length_penalty='marian' forces a prefix as it is "
        f"('forced')"
      )
    if self.stopping is not None and self.stopping not in STOPPING:
      raise ValueError(f"stopping={self.stopping!r}: must be one of {STOPPING} (or None)")
    check_prefix_rule(self.prefix_rule)
    if self.top_k and not self.sampling:
      raise ValueError(
        f"top_k={self.top_k} applies to sampling only: set a temperature (e.g. 1) or drop top_k"
      )
    if self.num_hypotheses > (1 if self.sampling else self.beam_size):
      raise ValueError(
        f"num_hypotheses={self.num_hypotheses}: at most beam_size={self.beam_size} hypotheses "
        f"come from a beam search" + (" (sampling draws one)" if self.sampling else "")
      )

  @property
  def sampling(self) -> bool:
    return self.temperature > 0

  @property
  def stopping_rule(self) -> str:
    """The stopping rule beam search follows: `stopping`, or unset the length penalty's own."""
    return stopping_rule(self.length_penalty, self.stopping)

  @property
  def rule_argument(self) -> bool:
    """Whether a compiled search may take its alpha and stopping rule as arguments instead of
    constants (beam search under the 'gnmt' or 'fairseq' penalty, or Marian's, whose alpha is
    its `normalize`: one program then serves every alpha and both rules; `rule_values` are the
    arguments, `with_rule` gives them to the search). The penalty's form stays a constant:
    XLA:CPU computes GNMT's ``(5 + len) / 6`` by a constant's own rules (docs/experiments.md)."""
    penalties = (*PENALTIES, MARIAN)
    return self.beam_size > 1 and not self.sampling and self.length_penalty in penalties

  def rule_values(self) -> tuple:
    """(alpha, 1.0 where the stopping rule is 'finished' else 0.0): the arguments of a search
    that takes its rule (`rule_argument`)."""
    return (self.alpha, float(self.stopping_rule == "finished"))

  def with_rule(self, values) -> SearchSettings:
    """These settings searching with `values` ([2] float32, traced: `rule_values`) as their
    alpha and stopping rule (a traced bool: 'finished' where true; Marian's search has its own
    rule and ignores it), inside a compiled search that takes them as arguments
    (`rule_argument`); not checked, and not for a static key."""
    if not self.rule_argument:
      raise ValueError(f"{self.describe()}: its rule is not an argument of its search")
    settings = dataclasses.replace(self, alpha=0.0, stopping=None)
    object.__setattr__(settings, "alpha", values[0])
    if self.length_penalty != MARIAN:
      object.__setattr__(settings, "stopping", values[1] > 0)
    return settings

  def replace(self, **changes) -> SearchSettings:
    """These settings with some fields changed (checked again)."""
    return dataclasses.replace(self, **changes)

  def program(self) -> SearchSettings:
    """The settings with the fields that do not change the computation reset, so that settings
    searching the same way share one compiled program (e.g. alpha when greedy; `stopping` unset
    when it names the length penalty's own rule)."""
    rule = dict(prefix_rule=self.prefix_rule)
    if self.sampling:
      return SearchSettings(
        1, 0.0, "gnmt", self.max_extra_len, self.temperature, self.top_k, 1, **rule
      )
    if self.length_penalty == MARIAN:  # its own stopping rule: `stopping` is unset
      return self
    if self.beam_size == 1:
      return SearchSettings(1, 0.0, "gnmt", self.max_extra_len, **rule)
    if self.stopping == stopping_rule(self.length_penalty):
      return self.replace(stopping=None)
    return self

  def describe(self) -> str:
    """'beam search (beam 5, alpha 1, fairseq length penalty)', for logs; a prefix rule other
    than the default is named after the search."""
    rule = "" if self.prefix_rule == "forced" else f", {self.prefix_rule} prefix rule"
    if self.sampling:
      return f"sampling at temperature {self.temperature:g} (top_k {self.top_k}){rule}"
    if self.length_penalty == MARIAN:
      return f"Marian's beam search (beam {self.beam_size}, normalize {self.alpha:g}){rule}"
    if self.beam_size == 1:
      return f"greedy search{rule}"
    form = "" if self.length_penalty == "gnmt" else f", {self.length_penalty} length penalty"
    if self.stopping is not None and self.stopping != stopping_rule(self.length_penalty):
      form += f", {self.stopping} stopping"
    return f"beam search (beam {self.beam_size}, alpha {self.alpha:g}{form}){rule}"


FIELDS = tuple(field.name for field in dataclasses.fields(SearchSettings))


def with_keywords(
  settings: SearchSettings | None, keywords: dict, defaults: dict | None = None
) -> tuple[SearchSettings, dict]:
  """(settings, the other keywords): `settings` (None: `SearchSettings(**defaults)`) with the
  `keywords` that name its fields replaced, checked; the keywords that name none come back
  unread, for the caller's own options or its error."""
  fields = {k: v for k, v in keywords.items() if k in FIELDS}
  rest = {k: v for k, v in keywords.items() if k not in FIELDS}
  if settings is None:
    settings = SearchSettings(**{**(defaults or {}), **fields})
  elif not isinstance(settings, SearchSettings):
    raise ValueError(f"settings={settings!r}: expected a SearchSettings")
  elif fields:
    settings = settings.replace(**fields)
  return settings, rest
