"""Fine-tuning: a run whose first state takes its parameters from another workdir's checkpoint
(`config.init_from`), with a fresh optimizer, schedule, step count and data position, and the
source's vocabulary (copied into this workdir, so that it decodes alone).

    source = resolve(config, workdir)           # None: no init_from, or the workdir resumes itself
    place_vocab(source, workdir)                # process 0, before the data pipeline reads it
    state = initial_state(source, parallel, rng)

`init_from` is `<workdir>[:latest|:<step>|:average:<k>]`, as decode.py's --checkpoint (the mean of
the last k checkpoints' parameters for average:k). Once this workdir has a checkpoint of its own,
`init_from` is not read again: a restart resumes the fine-tuning. The source workdir is only read,
without its lock. Every problem (no such checkpoint, another vocabulary, another model shape) is a
UsageError naming `init_from`, raised by `resolve` before anything is written (the shapes from the
checkpoint's metadata alone).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

import jax
import ml_collections
import numpy as np
from absl import logging

from core.errors import UsageError, first_line
from data import sources, tokenizer
from model.build import abstract_params
from training.average import average_params
from training.checkpoint import (
  available_steps,
  checkpoint_dir,
  choose_steps,
  describe_workdir,
  read_meta,
  restore_params,
  saved_shapes,
)
from training.compatibility import SHAPE_FIELDS, config_from_meta

SYNTAX = "<workdir>[:latest|:<step>|:average:<k>]"
_SPEC = re.compile(r"(.+?)(?::(latest|[0-9]+|average:[0-9]+))?")


@dataclasses.dataclass(frozen=True)
class Source:
  """The checkpoint(s) `init_from` names: `steps` of `workdir` (their mean for several), the
  config they were trained with and their vocabulary."""

  spec: str
  workdir: pathlib.Path
  steps: tuple[int, ...]
  config: ml_collections.ConfigDict
  vocab: tokenizer.Vocab

  def params(self):
    """The parameters as host numpy arrays (the mean of `steps` when several)."""
    trees = [restore_params(checkpoint_dir(self.workdir) / str(s))[0] for s in self.steps]
    return trees[0] if len(trees) == 1 else average_params(trees)


def _error(spec: str, problem: str) -> UsageError:
  return UsageError(f"config error: init_from={spec!r}: {problem}")


def resolve(config, workdir) -> Source | None:
  """The source of `config.init_from` for a run in `workdir`, checked (it exists, its vocabulary
  is the one this config may use); None when init_from is '' or `workdir` already has a
  checkpoint (the run resumes it). Reads only."""
  spec = str(config.get("init_from") or "")
  if not spec:
    return None
  workdir = pathlib.Path(workdir).absolute()
  if available_steps(workdir):
    return None
  if ":ensemble:" in spec:
    raise _error(spec, "an ensemble cannot start one model; use average:<k>")
  path, choice = _SPEC.fullmatch(spec).groups()
  src = pathlib.Path(path).absolute()
  if src == workdir:
    raise _error(spec, "names this run's own workdir; to continue a run, re-run it without this")
  steps = available_steps(src)
  if not steps:
    raise _error(
      spec, f"no checkpoint in {checkpoint_dir(src)} (expected {SYNTAX}); {describe_workdir(src)}"
    )
  try:
    chosen = choose_steps(steps, choice or "latest")
  except ValueError as e:
    raise _error(spec, str(e)) from None
  folder = checkpoint_dir(src) / str(chosen[-1])
  try:
    meta = read_meta(folder)
    src_config = config_from_meta(meta)
  except (OSError, ValueError, KeyError) as e:
    raise _error(spec, f"cannot read {folder}'s metadata ({first_line(e)})") from None
  vocab = _source_vocab(spec, src, src_config, meta.get("vocab"))
  _check_vocab(spec, config, vocab, src_config, workdir)
  source = Source(spec, src, tuple(chosen), src_config, vocab)
  model = config.model.copy_and_resolve_references()
  model.vocab_size = model.vocab_size or vocab.vocab_size  # as training/loop.py fit_model_vocab
  try:
    theirs = saved_shapes(folder)
  except Exception as e:  # noqa: BLE001 - damaged metadata: one line, not Orbax's traceback
    raise _error(spec, f"cannot read {folder}'s array metadata ({first_line(e)})") from None
  prefix = "params/"
  theirs = {k[len(prefix) :]: v for k, v in theirs.items() if k.startswith(prefix)}
  _check_shapes(source, model, theirs, _shapes(abstract_params(model)))
  return source


def _source_vocab(spec: str, src: pathlib.Path, src_config, fingerprint: str | None):
  """The vocabulary the source checkpoint was trained with: its workdir's file (train copies
  data.vocab_path there), else its data.vocab_path; the one of the recorded fingerprint."""
  paths = tokenizer.run_vocab_files(src, src_config.data)
  vocab, passed = tokenizer.load_matching(paths, fingerprint)
  if vocab is None:
    raise _error(
      spec,
      f"no vocabulary {fingerprint} (its checkpoints') in {src}"
      + (f" ({'; '.join(passed)})" if passed else ""),
    )
  return vocab


def _check_vocab(spec: str, config, vocab, src_config, workdir: pathlib.Path) -> None:
  """The run keeps the source's vocabulary: a config that names (data.vocab_path) or implies
  (the synthetic task's words) another one, or trains one of another size, is refused; so is a
  workdir already holding another."""
  data, theirs = config.data, f"the source model's vocabulary is {vocab.fingerprint}"
  if data.vocab_path:
    asked = tokenizer.load_vocab(data.vocab_path)
    if asked.fingerprint != vocab.fingerprint:
      raise _error(
        spec,
        f"data.vocab_path={data.vocab_path} is vocabulary {asked.fingerprint}, but {theirs}: "
        f"fine-tuning keeps it; unset data.vocab_path",
      )
  elif data.name == sources.SYNTHETIC:
    asked = tokenizer.WordVocab(sources.synthetic_words(data.synthetic_vocab))
    if asked.fingerprint != vocab.fingerprint:
      raise _error(
        spec,
        f"data.synthetic_vocab={data.synthetic_vocab} makes vocabulary {asked.fingerprint}, but "
        f"{theirs}: fine-tuning keeps it; use the source's data.synthetic_vocab",
      )
  elif not isinstance(vocab, tokenizer.SentencePieceVocab):
    raise _error(spec, f"this config trains a SentencePiece vocabulary, but {theirs} (a word list)")
  elif int(data.vocab_size) != int(src_config.data.vocab_size):
    raise _error(
      spec,
      f"data.vocab_size={data.vocab_size}, but the source model's vocabulary was made with "
      f"data.vocab_size={src_config.data.vocab_size}: fine-tuning keeps it; use that size",
    )
  here = workdir / tokenizer.workdir_name(vocab)
  if here.is_file() and tokenizer.load_vocab(here).fingerprint != vocab.fingerprint:
    raise _error(spec, f"{here} holds another vocabulary than {theirs}; use a new workdir")


def place_vocab(source: Source, workdir) -> None:
  """Writes the source's vocabulary into `workdir`, where the data pipeline finds it."""
  tokenizer.save_in_workdir(source.vocab, workdir)


def check_vocab(source: Source, vocab) -> None:
  """UsageError when the data pipeline built another vocabulary than the source's."""
  if vocab.fingerprint != source.vocab.fingerprint:
    raise _error(
      source.spec,
      f"the data gave vocabulary {vocab.fingerprint}, the source model's is "
      f"{source.vocab.fingerprint}",
    )


def _key(path) -> str:
  """A parameter's key path as 'decoder/layer_0/...'."""
  return "/".join(str(getattr(k, "key", k)) for k in path)


def _names(tree) -> dict[str, object]:
  return {_key(path): x for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _shapes(tree) -> dict[str, tuple[int, ...]]:
  return {k: tuple(np.shape(x)) for k, x in _names(tree).items()}


def _check_shapes(source: Source, model_cfg, theirs: dict, ours: dict) -> None:
  """UsageError naming the first parameter whose shape (or presence) differs between the source
  (`theirs`: name -> shape) and the model of `model_cfg` (its vocab_size fitted; `ours`)."""
  for name in sorted(ours.keys() | theirs.keys()):
    a, b = theirs.get(name), ours.get(name)
    shape_a = "absent" if a is None else f"shape {tuple(a)}"
    shape_b = "absent" if b is None else f"shape {tuple(b)}"
    if shape_a != shape_b:
      differs = [
        f"model.{k}: source {source.config.model.get(k)!r} != config {model_cfg.get(k)!r}"
        for k in SHAPE_FIELDS
        if source.config.model.get(k) != model_cfg.get(k)
      ]
      raise _error(
        source.spec,
        f"parameter {name} has {shape_a} in the source model but {shape_b} in this config's "
        f"model" + (f" ({'; '.join(differs)})" if differs else ""),
      )


def initial_state(source: Source, parallel, rng, config):
  """A fresh placed train state (training/parallel.py: optimizer, step and non-finite count as a
  new run's) holding the source's parameters (their shapes checked again against the state's)."""
  params = source.params()
  _check_shapes(source, config.model, _shapes(params), _shapes(parallel.abstract_state.params))
  theirs = _names(params)
  fresh = parallel.host_state(parallel.init_state(rng))
  params = jax.tree_util.tree_map_with_path(
    lambda path, x: np.asarray(theirs[_key(path)], x.dtype), fresh.params
  )
  logging.info(
    "fine-tuning from %s (steps %s): parameters taken, optimizer and step count fresh",
    source.workdir,
    ", ".join(map(str, source.steps)),
  )
  return parallel.place_state(fresh.replace(params=params))
