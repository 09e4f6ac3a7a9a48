"""Whether a checkpoint can continue under this run's config, and what differs between them.

The config a checkpoint was trained with is stored in it as JSON (never executed or unpickled).
A resume with another model shape or vocabulary is an error naming the fields; other changes
(optimizer settings, step count) are allowed and logged.
"""

from __future__ import annotations

import json

import ml_collections
from absl import logging

from core.errors import UsageError

# Model fields whose change makes a checkpoint's parameters unusable (or, pre_ln, meaningless).
SHAPE_FIELDS = (
  "type",
  "vocab_size",
  "d_model",
  "d_ff",
  "num_heads",
  "num_layers",
  "share_embeddings",
  "pre_ln",
  "rnn_cell",
  "rnn_bidirectional",
)


def config_from_meta(meta: dict) -> ml_collections.ConfigDict:
  """The training config stored in a checkpoint (JSON, never executed or unpickled)."""
  return ml_collections.ConfigDict(json.loads(meta["config"]))


def _differences(
  saved: ml_collections.ConfigDict, current: ml_collections.ConfigDict, fields
) -> list[str]:
  """'field: checkpoint a != config b' for each field ('section.key' or a top-level key) whose
  values differ."""
  out = []
  for field in fields:
    if "." in field:
      section, key = field.split(".", 1)
      a, b = (saved.get(section) or {}).get(key), (current.get(section) or {}).get(key)
    else:
      a, b = saved.get(field), current.get(field)
    if a != b:
      out.append(f"{field}: checkpoint {a!r} != config {b!r}")
  return out


def config_differences(
  saved: ml_collections.ConfigDict,
  current: ml_collections.ConfigDict,
  sections=("model", "optim"),
  top_level=(),
) -> str:
  """'model.x: checkpoint a != config b; ...' over every field of `sections` and the top-level
  keys `top_level` ('' when they agree)."""
  fields = [
    f"{sec}.{k}"
    for sec in sections
    for k in sorted(set((saved.get(sec) or {}).keys()) | set((current.get(sec) or {}).keys()))
  ]
  fields += list(top_level)
  diffs = _differences(saved, current, fields)
  return ("the checkpoint's config differs in " + "; ".join(diffs)) if diffs else ""


def check_compatible(saved: ml_collections.ConfigDict, current: ml_collections.ConfigDict):
  """Raises if `current` cannot continue the checkpoint: another model shape, or another
  data.vocab_size for a vocabulary the run trains itself (not synthetic, no data.vocab_path)."""
  fields = [f"model.{k}" for k in SHAPE_FIELDS]
  if current.data.name != "synthetic" and not current.data.vocab_path:
    fields.append("data.vocab_size")
  diffs = _differences(saved, current, fields)
  if diffs:
    raise UsageError(
      "the config does not match the checkpoint's (no silent re-initialisation; "
      "use a new workdir or the old settings): " + "; ".join(diffs)
    )


def check_resumable(meta: dict, config, vocab_fingerprint: str, where) -> None:
  """Raises UsageError when the run `config` with vocabulary `vocab_fingerprint` cannot continue
  the checkpoint whose metadata is `meta` (in folder `where`): another model shape
  (`check_compatible`) or another vocabulary."""
  check_compatible(config_from_meta(meta), config)
  saved = meta.get("vocab")
  if saved is not None and saved != vocab_fingerprint:
    raise UsageError(
      f"the checkpoint in {where} was trained with vocabulary {saved}, this run has "
      f"{vocab_fingerprint} (data.vocab_path or the workdir's vocabulary file changed): use a new "
      f"workdir or the old vocabulary"
    )


def log_changed_recipe(saved, config) -> None:
  """Resuming with other optimizer settings or step count is allowed; it is logged, since under a
  cosine schedule num_train_steps reshapes the rest of the decay."""
  changed = config_differences(saved, config, sections=("optim",), top_level=("num_train_steps",))
  if changed:
    cosine = config.optim.schedule == "cosine"
    logging.warning(
      "resuming with a changed recipe: %s%s",
      changed,
      " (the cosine decay now ends at num_train_steps)" if cosine else "",
    )
