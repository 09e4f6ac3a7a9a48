"""The search flags of decode.py and `python -m cli.ctranslate2_translate`: one flag per field of
model/search_settings.SearchSettings (its name, default and help), `num_hypotheses` excepted
(decode.py's --nbest), so that both command lines search with the same options and defaults.

    define_search_flags(flag_values, defaults={"max_extra_len": None}, notes={...})
    settings = SearchSettings(**search_fields(flag_values))  # its ValueError names the field,
                                                             # which cli/app.py prints as the flag
"""

from __future__ import annotations

import dataclasses

from absl import flags

from model.search_settings import (
  FIELDS,
  MARIAN,
  PENALTIES,
  PREFIX_RULES,
  STOPPING,
  SearchSettings,
)

EXCEPT = ("num_hypotheses",)


def define_search_flags(
  flag_values: flags.FlagValues = flags.FLAGS,
  defaults: dict | None = None,
  notes: dict[str, str] | None = None,
  omit: tuple[str, ...] = (),
) -> None:
  """Defines a flag for each SearchSettings field but `num_hypotheses` and those in `omit` (a
  command without their input keeps the fields' defaults): its default the field's unless
  `defaults` gives another (None: the caller fills it in), its help the field's followed by
  `notes[name]` where given."""
  defaults, notes = defaults or {}, notes or {}
  define = dict(flag_values=flag_values)
  for field in dataclasses.fields(SearchSettings):
    if field.name in EXCEPT or field.name in omit:
      continue
    default = defaults.get(field.name, field.default)
    help_text = field.metadata["help"] + (f" {notes[field.name]}" if field.name in notes else "")
    if field.name == "length_penalty":
      flags.DEFINE_enum(field.name, default, [*PENALTIES, MARIAN], help_text, **define)
    elif field.name == "stopping":
      flags.DEFINE_enum(field.name, default, list(STOPPING), help_text, **define)
    elif field.name == "prefix_rule":
      flags.DEFINE_enum(field.name, default, list(PREFIX_RULES), help_text, **define)
    elif field.type in ("int", int):
      flags.DEFINE_integer(field.name, default, help_text, **define)
    else:
      flags.DEFINE_float(field.name, default, help_text, **define)


def search_fields(flag_values: flags.FlagValues = flags.FLAGS, num_hypotheses: int = 1) -> dict:
  """The SearchSettings fields the flags give, with `num_hypotheses`; a flag whose value is None,
  or a field with no flag (`define_search_flags`' `omit`), is left out (the default applies)."""
  fields = {
    name: flag_values[name].value for name in FIELDS if name not in EXCEPT and name in flag_values
  }
  fields["num_hypotheses"] = num_hypotheses
  return {name: value for name, value in fields.items() if value is not None}
