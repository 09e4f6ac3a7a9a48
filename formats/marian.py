"""Marian / OPUS-MT models in, this project's parameters, model options and vocabulary out.

    release = read_release("opus-mt-en-de.zip")        # formats/marian_files.py
    imported = convert(release)                         # or convert(release, follow="ctranslate2")
    imported.model_options, imported.params, imported.vocab
    write_workdir(imported, "runs/opus-en-de")          # config.json, vocab.json, a checkpoint

A release holds the weights (`*.npz`, the model's options in its `special:model.yml` entry, an
int8 array ending in NUL, padded with NULs by newer Marians), the vocabulary (`*.vocab.yml`:
piece -> Marian id, `</s>` 0 and `<unk>` 1), the SentencePiece models `source.spm` and
`target.spm`, and `decoder.yml` (which npz and vocabularies to use), all read as untrusted input
(formats/marian_files.py). Whatever cannot be imported exactly is refused with a one-line
`MarianError` naming the file, key and value, before anything is written.

Ids: Marian's `</s>` and `<unk>` become EOS and UNK (ids 1 and 2), its piece k >= 2 becomes id
k + 2; PAD (0) and SEP (3), which Marian has not, get zero embedding rows and an output bias of
`ABSENT_BIAS`, so that they never win and take no probability (the log-softmax over the other
ids is Marian's). Marian's first decoder input (a zero vector) is the decoder's start symbol PAD
read as zeros (`model.decoder_start='zero'`).

`follow='ctranslate2'` imports the model as CTranslate2's Marian converter does (its position
table `10000^(2i/d)` in Marian's sin|cos layout and LayerNorm epsilon 1e-5), to compare with
CTranslate2's output; 'marian' (the default) is Marian's own computation.
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np

from data.tokenizer import MarianVocab
from formats.marian_files import (
  MODEL_YML,
  MarianError,
  model_config,
  read_npz,
  read_vocab_yml,
  yaml_document,
)
from model.special_tokens import EOS_ID, NUM_SPECIAL, SPECIAL_PIECES, UNK_ID

ABSENT_BIAS = -100.0  # output bias of PAD and SEP: exp(-100) vanishes beside any real logit
FOLLOW = ("marian", "ctranslate2")
FINETUNE_CONFIG = "finetune_config.py"  # train.py --config=<workdir>/finetune_config.py
_FINETUNE = '''"""Fine-tuning the model imported into {workdir}: its config (config.json),
started from its parameters (init_from) with its vocabulary; give the data on the command line:
--config.data.name=files --config.data.dir=<folder> --config.data.source_lang=en
--config.data.target_lang=de."""

import json
import pathlib

import ml_collections

WORKDIR = pathlib.Path({workdir!r})


def get_config():
  config = ml_collections.ConfigDict(json.loads((WORKDIR / "config.json").read_text()))
  config.init_from = str(WORKDIR)
  config.data.vocab_path = str(WORKDIR / "vocab.json")
  return config
'''
MAX_LEN = 512  # model.max_len of an imported model (Marian's default max-length is 1000)
SPM_FILES = ("source.spm", "target.spm")


# --- options -------------------------------------------------------------------------------------

# Marian options that must have one value (Marian's default when the key is absent).
_FIXED = {
  "transformer-decoder-autoreg": ("self-attention", "self-attention"),
  "transformer-no-projection": (False, False),
  "transformer-train-positions": (False, False),
  "transformer-disable-position-embeddings": (False, False),
  "transformer-tied-layers": ([], []),
  "transformer-pool": (False, False),
  "transformer-ffn-depth": (2, 2),
  "transformer-attention-mask": ("default", "default"),
  "output-omit-bias": (False, False),
  "lemma-dim-emb": (0, 0),
  "ulr": (False, False),
}
_ACTIVATIONS = ("swish", "relu", "gelu")


def model_options(config: dict, name: str) -> dict:
  """This project's `model.*` fields for a Marian transformer's options; MarianError naming the
  key and value of any option it cannot follow exactly."""

  def refuse(key, why):
    raise MarianError(f"{name}: option {key}={config.get(key)!r} is not supported ({why})")

  def need(key):
    if key not in config:
      raise MarianError(f"{name}: option {key} is missing from {MODEL_YML}")
    return config[key]

  if need("type") != "transformer":
    refuse("type", "only 'transformer' is")
  for key, (default, wanted) in _FIXED.items():
    if config.get(key, default) != wanted and not (wanted == [] and not config.get(key)):
      refuse(key, f"only {wanted!r} is")
  d_model = int(need("dim-emb"))
  d_ff = int(need("transformer-dim-ffn"))
  heads = int(need("transformer-heads"))
  layers = int(need("enc-depth"))
  if int(need("dec-depth")) != layers:
    refuse("dec-depth", f"the decoder must have as many layers as the encoder ({layers})")
  if int(config.get("transformer-decoder-ffn-depth", 0) or 0) not in (0, 2):
    refuse("transformer-decoder-ffn-depth", "only 0 or 2 is")
  if int(config.get("transformer-decoder-dim-ffn", 0) or 0) not in (0, d_ff):
    refuse("transformer-decoder-dim-ffn", f"only 0 or transformer-dim-ffn={d_ff} is")
  activation = config.get("transformer-ffn-activation", "swish")
  if activation not in _ACTIVATIONS:
    refuse("transformer-ffn-activation", f"one of {_ACTIVATIONS} is")
  if config.get("transformer-postprocess-emb", "d") not in ("d", ""):
    refuse("transformer-postprocess-emb", "a LayerNorm of the embeddings is not")
  pre = config.get("transformer-preprocess", "")
  post = config.get("transformer-postprocess", "dan")
  top = config.get("transformer-postprocess-top", "") or ""
  if pre == "":
    if post != "dan":
      refuse("transformer-postprocess", "post-norm needs 'dan'")
    if top != "":
      refuse("transformer-postprocess-top", "post-norm needs ''")
  elif pre == "n":
    if post != "da":
      refuse("transformer-postprocess", "pre-norm needs 'da'")
    if top != "n":
      refuse("transformer-postprocess-top", "pre-norm needs 'n'")
  else:
    refuse("transformer-preprocess", "'' (post-norm) or 'n' (pre-norm) is")
  vocabs = config.get("dim-vocabs")
  if not isinstance(vocabs, list) or len(vocabs) != 2 or vocabs[0] != vocabs[1]:
    refuse("dim-vocabs", "one vocabulary of one size for source and target is")
  tied_all = bool(config.get("tied-embeddings-all", False))
  tied_src = bool(config.get("tied-embeddings-src", False))
  tied = bool(config.get("tied-embeddings", False))
  return {
    "d_model": d_model,
    "d_ff": d_ff,
    "num_heads": heads,
    "num_layers": layers,
    "ffn_activation": activation,
    "pre_ln": pre == "n",
    "share_embeddings": tied_all,
    "marian_vocab_size": int(vocabs[0]),
    "tied": "all" if tied_all else ("src" if tied_src else "") + ("output" if tied else ""),
  }


# --- parameters ----------------------------------------------------------------------------------


def our_ids(marian_size: int) -> np.ndarray:
  """[marian_size] our id of each Marian id: 0 -> EOS, 1 -> UNK, k -> k + 2."""
  ids = np.arange(marian_size) + (NUM_SPECIAL - 2)
  ids[0], ids[1] = EOS_ID, UNK_ID
  return ids


def _rows(table: np.ndarray, size: int, fill: float = 0.0) -> np.ndarray:
  """A [marian_size, ...] table as [size, ...] in our ids (PAD and SEP rows `fill`)."""
  out = np.full((size, *table.shape[1:]), fill, np.float32)
  out[our_ids(table.shape[0])] = table
  return out


class _Weights:
  """The npz arrays, each taken once, checked for its shape."""

  def __init__(self, arrays: dict[str, np.ndarray], name: str):
    self.arrays = {k: v for k, v in arrays.items() if k != MODEL_YML}
    self.name = name
    self.used: set[str] = set()

  def __call__(self, key: str, shape: tuple[int, ...]) -> np.ndarray:
    if key not in self.arrays:
      raise MarianError(f"{self.name}: weight {key!r} is missing")
    value = self.arrays[key]
    if tuple(value.shape) != tuple(shape):
      raise MarianError(f"{self.name}: weight {key!r} is {value.shape}, expected {shape}")
    if value.dtype.kind != "f":
      raise MarianError(f"{self.name}: weight {key!r} is {value.dtype}, not floating point")
    self.used.add(key)
    return np.asarray(value, np.float32)

  def has(self, key: str) -> bool:
    return key in self.arrays

  def check_all_used(self) -> None:
    left = sorted(set(self.arrays) - self.used)
    if left:
      raise MarianError(f"{self.name}: weight {left[0]!r} is not part of a supported model")


def convert_params(arrays: dict[str, np.ndarray], options: dict, name: str) -> dict:
  """This project's parameter tree (numpy float32) from Marian's weights."""
  w = _Weights(arrays, name)
  d, ff, h = options["d_model"], options["d_ff"], options["num_heads"]
  marian_v = options["marian_vocab_size"]
  v = marian_v + 2
  dk = d // h
  norm_suffix = "_pre" if options["pre_ln"] else ""

  def norm(prefix):
    return {
      "norm": {
        "scale": w(f"{prefix}_ln_scale{norm_suffix}", (1, d))[0],
        "bias": w(f"{prefix}_ln_bias{norm_suffix}", (1, d))[0],
      }
    }

  def attention(prefix):
    out = {}
    for ours, theirs in (("query", "q"), ("key", "k"), ("value", "v")):
      out[ours] = {"kernel": w(f"{prefix}_W{theirs}", (d, d)).reshape(d, h, dk)}
      out[f"{ours}_bias"] = w(f"{prefix}_b{theirs}", (1, d)).reshape(h, dk)
    out["out"] = {
      "kernel": w(f"{prefix}_Wo", (d, d)).reshape(h, dk, d),
      "bias": w(f"{prefix}_bo", (1, d))[0],
    }
    return out

  def ffn(prefix):
    return {
      "wi": {"kernel": w(f"{prefix}_W1", (d, ff)), "bias": w(f"{prefix}_b1", (1, ff))[0]},
      "wo": {"kernel": w(f"{prefix}_W2", (ff, d)), "bias": w(f"{prefix}_b2", (1, d))[0]},
    }

  encoder, decoder = {}, {}
  for i in range(options["num_layers"]):
    e, dd = f"encoder_l{i + 1}", f"decoder_l{i + 1}"
    encoder[f"layer_{i}"] = {
      "self_attention": attention(f"{e}_self"),
      "attention_block": norm(f"{e}_self_Wo"),
      "ffn": ffn(f"{e}_ffn"),
      "ffn_block": norm(f"{e}_ffn_ffn"),
    }
    decoder[f"layer_{i}"] = {
      "self_attention": attention(f"{dd}_self"),
      "self_attention_block": norm(f"{dd}_self_Wo"),
      "cross_attention": attention(f"{dd}_context"),
      "cross_attention_block": norm(f"{dd}_context_Wo"),
      "ffn": ffn(f"{dd}_ffn"),
      "ffn_block": norm(f"{dd}_ffn_ffn"),
    }
  if options["pre_ln"]:
    for stack, tree in (("encoder", encoder), ("decoder", decoder)):
      tree["final_norm"] = {
        "scale": w(f"{stack}_top_ln_scale", (1, d))[0],
        "bias": w(f"{stack}_top_ln_bias", (1, d))[0],
      }
  bias = _rows(w("decoder_ff_logit_out_b", (1, marian_v))[0], v, ABSENT_BIAS)
  tied = options["tied"]
  params = {"encoder": encoder, "decoder": decoder}
  if tied == "all":
    params["embed"] = {"embedding": _rows(w("Wemb", (marian_v, d)), v)}
    decoder["logits_bias"] = bias
    return _done(w, params)
  source = w("Wemb" if "src" in tied else "encoder_Wemb", (marian_v, d))
  target = source if "src" in tied else w("decoder_Wemb", (marian_v, d))
  if "output" in tied:
    output = target
  elif w.has("decoder_ff_logit_out_Wt"):
    output = w("decoder_ff_logit_out_Wt", (marian_v, d))
  else:  # Marian's older untransposed layout
    output = w("decoder_ff_logit_out_W", (d, marian_v)).T
  params["embed"] = {"embedding": _rows(source, v)}
  params["target_embed"] = {"embedding": _rows(target, v)}
  decoder["logits"] = {"kernel": _rows(output, v).T.copy(), "bias": bias}
  return _done(w, params)


def _done(w: _Weights, params: dict) -> dict:
  w.check_all_used()
  return params


# --- the whole release ---------------------------------------------------------------------------


@dataclasses.dataclass
class Imported:
  """An imported model: `model_options` (the config's `model.*` fields), `params` (the parameter
  tree, numpy float32), `vocab` (a MarianVocab), `decoder` (decoder.yml's options, {} if none),
  `search` (the `eval.*` decoding defaults decoder.yml gives: `decoder_search`)."""

  model_options: dict
  params: dict
  vocab: MarianVocab
  decoder: dict
  search: dict = dataclasses.field(default_factory=dict)


def _file(release: dict[str, bytes], name: str) -> bytes:
  if name not in release:
    raise MarianError(f"the release has no {name}")
  return release[name]


def _plain_name(value, key: str) -> str:
  if not isinstance(value, str) or "/" in value or "\\" in value or value in ("", ".", ".."):
    raise MarianError(f"decoder.yml: {key}={value!r} must name a file of the release")
  return value


def decoder_search(decoder: dict) -> dict:
  """The decoding defaults of decoder.yml, as config fields: `beam-size` -> eval.beam_size,
  `normalize` (Marian's length normalisation exponent) -> eval.alpha; MarianError naming the key
  for a value out of range. Options it does not give keep the config's defaults."""
  search = {}
  size = decoder.get("beam-size")
  if size is not None:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
      raise MarianError(f"decoder.yml: beam-size={size!r}: expected a positive integer")
    search["beam_size"] = size
  normalize = decoder.get("normalize")  # true: a flag without its value, 1 in Marian
  if normalize is not None:
    if not isinstance(normalize, (int, float)) or not 0 <= normalize < float("inf"):
      raise MarianError(f"decoder.yml: normalize={normalize!r}: expected a number >= 0")
    search["alpha"] = float(normalize)
  return search


def convert(release: dict[str, bytes], follow: str = "marian") -> Imported:
  """The model of a release read by `read_release`; MarianError (one line) when anything is
  missing, unreadable or not supported."""
  if follow not in FOLLOW:
    raise MarianError(f"follow={follow!r}: must be one of {FOLLOW}")
  decoder = {}
  if "decoder.yml" in release:
    decoder = yaml_document(release["decoder.yml"], "decoder.yml")
    if not isinstance(decoder, dict):
      raise MarianError("decoder.yml: not a mapping of options")
    models, vocabs = decoder.get("models"), decoder.get("vocabs")
    if not isinstance(models, list) or len(models) != 1:
      raise MarianError(f"decoder.yml: models={models!r}: expected one model (no ensembles)")
    if not isinstance(vocabs, list) or len(vocabs) != 2:
      raise MarianError(f"decoder.yml: vocabs={vocabs!r}: expected a source and a target one")
    npz_name = _plain_name(models[0], "models")
    vocab_names = [_plain_name(x, "vocabs") for x in vocabs]
  else:
    npzs = sorted(n for n in release if n.endswith(".npz"))
    ymls = sorted(n for n in release if n.endswith(".vocab.yml"))
    if len(npzs) != 1 or len(ymls) != 1:
      raise MarianError(
        f"the release has no decoder.yml and {len(npzs)} *.npz, {len(ymls)} *.vocab.yml files: "
        f"expected one of each"
      )
    npz_name, vocab_names = npzs[0], ymls * 2
  search = decoder_search(decoder)
  spms = [_file(release, n) for n in SPM_FILES]
  vocab_data = [_file(release, n) for n in vocab_names]
  arrays = read_npz(_file(release, npz_name), npz_name)
  if vocab_data[0] != vocab_data[1]:
    pieces = [read_vocab_yml(x, n) for x, n in zip(vocab_data, vocab_names)]
    if pieces[0] != pieces[1]:
      raise MarianError(
        f"{vocab_names[0]} and {vocab_names[1]} differ: separate source and target "
        f"vocabularies are not supported"
      )
  pieces = read_vocab_yml(vocab_data[1], vocab_names[1])
  options = model_options(model_config(arrays, npz_name), npz_name)
  if len(pieces) != options["marian_vocab_size"]:
    raise MarianError(
      f"{vocab_names[1]} has {len(pieces)} pieces, but the model's embeddings have "
      f"{options['marian_vocab_size']} rows (dim-vocabs)"
    )
  params = convert_params(arrays, options, npz_name)
  vocab = MarianVocab(list(SPECIAL_PIECES) + pieces[2:], *spms)
  ctranslate2 = follow == "ctranslate2"
  fields = {
    "type": "transformer",
    "vocab_size": vocab.vocab_size,
    "d_model": options["d_model"],
    "d_ff": options["d_ff"],
    "num_heads": options["num_heads"],
    "num_layers": options["num_layers"],
    "share_embeddings": options["share_embeddings"],
    "pre_ln": options["pre_ln"],
    "ffn_activation": options["ffn_activation"],
    "position_layout": "concatenated",
    "position_frequencies": "paper" if ctranslate2 else "marian",
    "layer_norm_epsilon": 1e-5 if ctranslate2 else 1e-6,
    "decoder_start": "zero",
    "attention_bias": True,
    "output_bias": options["share_embeddings"],
    # Marian's pre-norm decoder, step by step, attends over un-normalised inputs (not CTranslate2).
    "raw_self_keys": options["pre_ln"] and not ctranslate2,
    "max_len": MAX_LEN,
  }
  return Imported(fields, params, vocab, decoder, search)


def config_for(imported: Imported):
  """The run config of an imported model: every field at its default but `model.*` (the
  model's), the vocabulary's size and decoding's defaults (Marian's search, with decoder.yml's
  beam size and normalisation)."""
  from configs.common import base_config

  config = base_config()
  config.model.update(imported.model_options)
  config.data.vocab_size = imported.vocab.vocab_size
  config.eval.length_penalty = "marian"  # decode.py searches as Marian unless told otherwise
  config.eval.update(imported.search)  # and with decoder.yml's beam size and normalisation
  return config


def write_workdir(imported: Imported, workdir) -> pathlib.Path:
  """Writes `workdir` (which must not exist, or be empty): its vocabulary (vocab.json) and a
  step-0 checkpoint holding the parameters and the config, as training writes them, so that
  decoding, export and fine-tuning (`init_from`) read it as any other workdir."""
  from data.tokenizer import save_in_workdir
  from training.checkpoint import Checkpointer

  workdir = pathlib.Path(workdir)
  if workdir.exists() and (not workdir.is_dir() or any(workdir.iterdir())):
    raise MarianError(f"workdir={str(workdir)!r}: exists and is not an empty folder")
  config = config_for(imported)
  workdir.mkdir(parents=True, exist_ok=True)
  save_in_workdir(imported.vocab, workdir)
  meta = {
    "config": config.to_json(),
    "seed": 0,
    "step": 0,
    "vocab": imported.vocab.fingerprint,
    "imported_from": "marian",
  }
  (workdir / "config.json").write_text(config.to_json_best_effort(indent=2) + "\n")
  (workdir / FINETUNE_CONFIG).write_text(_FINETUNE.format(workdir=str(workdir.absolute())))
  checkpointer = Checkpointer(workdir, async_save=False)
  checkpointer.save(0, {"params": imported.params}, meta, force=True)
  checkpointer.wait()
  return workdir
