"""Every configuration field: its default, what it means, and what values it takes. Config files
start from `base_config()` and change what differs; any field can be overridden on the command
line (`--config.model.num_layers=2`), a field that is not here is an error, and `--show_config`
prints the resolved config with these descriptions. The `model.*` fields are model/config.py's
hyperparameters, declared there once. `training/validate.py` checks every value against its rule
before any work.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from core.rules import Bool, Choice, Float, Int, Rule, Text, allowing
from model import config as model_config
from model.search_settings import SearchSettings
from model.special_tokens import NUM_SPECIAL


@dataclasses.dataclass(frozen=True)
class Field:
  default: Any
  help: str
  rule: Rule


FRACTION = Float(min=0.0, below=1.0)
POSITIVE = Int(min=1)
COUNT = Int(min=0)
_SEARCH = {f.name: f for f in dataclasses.fields(SearchSettings)}  # decoding's defaults
MESH_AXIS = Int(min=1, also=(-1,))


def _model_fields() -> dict[str, Field]:
  """`model.type`, then the hyperparameters of model/config.py as they are declared there (the
  Transformer's, then the other types' own), with the values a config may hold until they are
  resolved (model.vocab_size=0, model.dtype='auto')."""
  types = model_config.MODEL_TYPES
  out = {"model.type": Field(types[0], "the model: " + ", ".join(types), Choice(*types))}
  for config_class in (model_config.TransformerConfig, model_config.RNNConfig):
    for field in dataclasses.fields(config_class):
      meta = field.metadata
      required = field.default is dataclasses.MISSING
      default = meta[model_config.CONFIG_DEFAULT] if required else field.default
      resolved = (default,) if required else meta[model_config.RESOLVED]
      rule = allowing(meta[model_config.RULE], *resolved) if resolved else meta[model_config.RULE]
      out.setdefault(f"model.{field.name}", Field(default, meta[model_config.HELP], rule))
  return out


# Dotted name -> Field, in the order --show_config prints them.
FIELDS: dict[str, Field] = {
  "seed": Field(0, "random seed of the initial parameters, dropout and the batch order", COUNT),
  "num_train_steps": Field(
    100_000, "optimizer steps of the whole run (a resume continues to it)", POSITIVE
  ),
  "log_every_steps": Field(
    100, "steps between train records (metrics.jsonl, TensorBoard, log)", POSITIVE
  ),
  "eval_every_steps": Field(
    1_000, "steps between evaluations on data.eval_split (also one at the end)", POSITIVE
  ),
  "checkpoint_every_steps": Field(
    1_000, "steps between checkpoints (also one at the end)", POSITIVE
  ),
  "init_from": Field(
    "",
    "fine-tune from <workdir>[:latest|:<step>|:average:<k>]: its parameters, vocabulary; '' = off",
    Text(),
  ),
  "stop_timeout_s": Field(
    600.0,
    "seconds after SIGTERM/SIGINT before a process still running is hung and exits; 0 = wait",
    Float(min=0.0),
  ),
  "parallelism": Field(
    "mesh",
    "'pmap' (data parallel, replicated state) or 'mesh' (jit over a Mesh, sharded state)",
    Choice("pmap", "mesh"),
  ),
  "num_devices": Field(0, "devices of each process to use; 0 = all", COUNT),
  "mesh.data": Field(-1, "mesh axis splitting the batch; -1 = the devices left", MESH_AXIS),
  "mesh.fsdp": Field(
    1,
    "mesh axis splitting the batch and sharding parameters and Adam moments over 'embed'",
    MESH_AXIS,
  ),
  "mesh.tensor": Field(1, "mesh axis sharding heads, d_ff and the vocabulary", MESH_AXIS),
  **_model_fields(),
  "data.name": Field(
    "synthetic",
    "'synthetic', 'multi30k' (fetched, cached), 'files' (data.dir) or a TFDS translation dataset",
    Text(),
  ),
  "data.dir": Field(
    "",
    "a folder of <split>.<lang>[.gz] files ('files'; 'multi30k' reads it, fetching none)",
    Text(),
  ),
  "data.url": Field(
    "",
    "'multi30k': base URL + data/task1/raw/<split>.<lang>.gz; '' = data/multi30k.py's",
    Text(),
  ),
  "data.tfds_data_dir": Field("", "TFDS data_dir; '' = TFDS's default", Text()),
  "data.source_lang": Field("en", "source language (file suffix or TFDS feature)", Text()),
  "data.target_lang": Field("de", "target language (file suffix or TFDS feature)", Text()),
  "data.train_split": Field("train", "split trained on", Text()),
  "data.eval_split": Field("validation", "split evaluated on", Text()),
  "data.vocab_size": Field(
    8000,
    "pieces of the SentencePiece vocabulary trained on the train split (specials included)",
    Int(min=NUM_SPECIAL + 1),
  ),
  "data.vocab_path": Field(
    "", "an existing vocabulary (.model or .json) instead of training one", Text()
  ),
  "data.tokens_per_batch": Field(4096, "padded target tokens per global batch", POSITIVE),
  "data.max_len": Field(
    64, "longest example in tokens, EOS included; the packed row length", Int(min=2)
  ),
  "data.packing": Field(
    True, "pack examples into rows of data.max_len (one shape), else bucket by length", Bool()
  ),
  "data.truncate": Field(
    False, "cut examples longer than data.max_len instead of dropping them", Bool()
  ),
  "data.cache_dir": Field("", "token-id cache; '' = <workdir>/cache", Text()),
  "data.synthetic_num_train": Field(20_000, "synthetic task: training sentences", POSITIVE),
  "data.synthetic_num_eval": Field(500, "synthetic task: validation and test sentences", POSITIVE),
  "data.synthetic_vocab": Field(32, "synthetic task: words w0 ... w<n-1>", POSITIVE),
  "data.synthetic_min_len": Field(4, "synthetic task: shortest sentence in words", POSITIVE),
  "data.synthetic_max_len": Field(12, "synthetic task: longest sentence in words", POSITIVE),
  "data.synthetic_seed": Field(
    0, "synthetic task: seed of its word permutation and sentences", COUNT
  ),
  "optim.schedule": Field(
    "rsqrt",
    "learning-rate schedule: rsqrt (the paper's), constant or cosine",
    Choice("rsqrt", "constant", "cosine"),
  ),
  "optim.learning_rate": Field(
    1.0, "factor of the rsqrt schedule, or the peak rate of the others", Float(above=0.0)
  ),
  "optim.warmup_steps": Field(4000, "steps of linear warmup", COUNT),
  "optim.b1": Field(0.9, "Adam's beta1", FRACTION),
  "optim.b2": Field(0.98, "Adam's beta2", FRACTION),
  "optim.eps": Field(1e-9, "Adam's epsilon", Float(above=0.0)),
  "optim.weight_decay": Field(0.0, "decoupled weight decay (AdamW); 0 = off", Float(min=0.0)),
  "optim.clip_norm": Field(0.0, "global-norm gradient clipping; 0 = off", Float(min=0.0)),
  "optim.label_smoothing": Field(0.1, "label smoothing (epsilon_ls)", FRACTION),
  "optim.grad_accum_steps": Field(
    1, "micro-batches whose gradients are summed per update", POSITIVE
  ),
  "optim.max_nonfinite_steps": Field(
    10, "consecutive skipped (non-finite) updates before training stops", POSITIVE
  ),
  "eval.num_batches": Field(0, "eval batches per evaluation; 0 = the whole split", COUNT),
  "eval.bleu_sentences": Field(
    256, "sentences decoded greedily for BLEU at each evaluation; 0 = none", COUNT
  ),
  "eval.max_decode_extra": Field(
    50, "decoding's output length limit = source tokens + this", COUNT
  ),
  "eval.beam_size": Field(
    _SEARCH["beam_size"].default,
    "decoding's default beam size (decode.py --beam_size): an import's decoder.yml beam-size",
    POSITIVE,
  ),
  "eval.alpha": Field(
    _SEARCH["alpha"].default,
    "decoding's default length penalty exponent (decode.py --alpha): an import's normalize",
    Float(min=0.0),
  ),
  "eval.length_penalty": Field(
    "gnmt",
    "decoding's default search rule (decode.py --length_penalty): marian for an imported model",
    Choice("gnmt", "fairseq", "marian"),
  ),
  "early_stopping.patience": Field(
    0, "evaluations in a row without a gain that end the run (a final checkpoint); 0 = off", COUNT
  ),
  "early_stopping.metric": Field(
    "bleu",
    "what early stopping watches: val 'bleu' (higher) or 'loss' (lower)",
    Choice("bleu", "loss"),
  ),
  "early_stopping.min_delta": Field(
    0.0,
    "the least gain over the best that counts (BLEU points or loss; always > 0)",
    Float(min=0.0),
  ),
  "checkpoint.keep": Field(5, "newest checkpoints kept", POSITIVE),
  "checkpoint.keep_best": Field(0, "also keep this many best by eval BLEU; 0 = off", COUNT),
  "checkpoint.async_save": Field(
    True, "write checkpoints in the background while training goes on", Bool()
  ),
  "bench.batch_size": Field(16, "bench.py: sentences per batch", POSITIVE),
  "bench.seq_len": Field(64, "bench.py: source and target tokens per sentence", Int(min=2)),
  "bench.decode_len": Field(48, "bench.py --mode=decode: output tokens per sentence", POSITIVE),
  "bench.beam_size": Field(4, "bench.py --mode=decode: beam size (1 = greedy)", POSITIVE),
}


def _nested(prefix: str = "") -> ml_collections.ConfigDict:
  """The defaults of the fields under `prefix` ('' = all) as a nested ConfigDict."""
  out: dict[str, Any] = {}
  for name, field in FIELDS.items():
    if not name.startswith(prefix):
      continue
    *sections, key = name[len(prefix) :].split(".")
    node = out
    for section in sections:
      node = node.setdefault(section, {})
    node[key] = field.default
  return ml_collections.ConfigDict(out)


def base_config() -> ml_collections.ConfigDict:
  """Every field at its default."""
  return _nested()


def data_defaults() -> ml_collections.ConfigDict:
  """The `config.data` fields at their defaults (the built-in synthetic task)."""
  return _nested("data.")


def describe(config) -> list[str]:
  """`name = value  # description` for every field of `config`, in FIELDS' order; fields the
  config has beyond FIELDS (none, for a config built from base_config) come last, undescribed."""
  flat = _flatten(config)
  names = [n for n in FIELDS if n in flat] + [n for n in flat if n not in FIELDS]
  width = max(len(f"{n} = {flat[n]!r}") for n in names)
  return [
    f"{f'{n} = {flat[n]!r}':<{width}}  # {FIELDS[n].help if n in FIELDS else ''}".rstrip(" #")
    for n in names
  ]


def _flatten(config, prefix: str = "") -> dict[str, Any]:
  out = {}
  for key, value in config.items():
    if isinstance(value, (ml_collections.ConfigDict, dict)):
      out.update(_flatten(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out
