"""Tiny Marian / OPUS-MT releases with random weights, written with numpy and yaml only (the
SentencePiece models are trained on generated text with the sentencepiece package), for the
importer's tests (tests/test_marian.py).

    write_release(folder, Variant(activation="relu", tied="none", pre_norm=True), seed=0)

The folder gets what an OPUS-MT release holds: `model.npz` (Marian's weight names and shapes,
its options in `special:model.yml`), `vocab.yml` (named twice in `decoder.yml`), `source.spm`,
`target.spm`, `decoder.yml`. The weights make short outputs that end by themselves: the output
bias favours `</s>` a little, the rest is random.
"""

from __future__ import annotations

import dataclasses
import io
import json
import pathlib
import random

import numpy as np
import yaml

# Characters a vocabulary yml must quote or escape, among plain words.
ODD = ['"', "'", ":", "#", "\\", "-", "?", "!", "%", "[", "&", "*", "yes", "null", "1", "2.5"]
WORDS = [
  "the", "a", "house", "garden", "dog", "cat", "runs", "sleeps", "big", "small", "red", "green",
  "over", "under", "near", "river", "tree", "bird", "sings", "loud", "quiet", "old", "new", "man",
]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Variant:
  activation: str = "swish"  # Marian's transformer-ffn-activation
  tied: str = "all"  # all (tied-embeddings-all), output (tied-embeddings), none
  pre_norm: bool = False
  pad_config: bool = False  # the config NUL-padded to a 256-byte multiple (newer Marians)
  d_model: int = 16
  d_ff: int = 32
  heads: int = 2
  layers: int = 2
  eos_bias: float = 1.5
  emb_scale: float = 1.0
  logit_scale: float = 1.0
  sublayer_scale: float = 1.0  # of W_o and W_2: below 1, the residual path (positions) dominates
  eos_ramp: float = 0.0  # weight of `</s>`'s output row on a rising position channel
  ramp_channel: int = 1  # sin(pos * 1e4^(-c/(d/2-1))) of Marian's table
  context_scale: float = 1.0  # of the encoder-decoder attention's W_o
  eos_after: float = 0.0  # weight of `</s>`'s output row on the mean input embedding of 1/4 of
  # the pieces: `</s>` tends to follow them


def sentences(count: int, seed: int) -> list[str]:
  """Generated sentences of 3 to 9 words, some with the odd characters."""
  rng = random.Random(seed)
  out = []
  for _ in range(count):
    words = [rng.choice(WORDS) for _ in range(rng.randint(3, 9))]
    if rng.random() < 0.5:
      words.insert(rng.randrange(len(words) + 1), rng.choice(ODD))
    out.append(" ".join(words))
  return out


def train_spm(texts: list[str], vocab_size: int, seed: int) -> bytes:
  import sentencepiece as spm

  model = io.BytesIO()
  spm.set_random_generator_seed(seed)
  spm.SentencePieceTrainer.train(
    sentence_iterator=iter(texts),
    model_writer=model,
    vocab_size=vocab_size,
    model_type="unigram",
    character_coverage=1.0,
    hard_vocab_limit=False,
    num_threads=1,
    minloglevel=2,
  )
  return model.getvalue()


def spm_pieces(proto: bytes) -> list[str]:
  import sentencepiece as spm

  sp = spm.SentencePieceProcessor()
  sp.LoadFromSerializedProto(proto)
  return [
    sp.id_to_piece(i)
    for i in range(sp.get_piece_size())
    if not (sp.is_control(i) or sp.is_unknown(i))
  ]


def _yml_key(piece: str) -> str:
  """A piece as a vocabulary yml key: plain where YAML reads it back as that string, else
  double-quoted with escapes (as Marian's emitter writes such pieces)."""
  plain = (
    piece.isalnum()
    and not piece.isdigit()
    and piece.lower() not in ("yes", "no", "true", "false", "null", "on", "off", "y", "n")
  ) or (piece.startswith("\u2581") and piece[1:].isalpha())
  return piece if plain else json.dumps(piece, ensure_ascii=False)


def vocab_yml(pieces: list[str]) -> str:
  """Marian's vocabulary yml: `</s>` 0, `<unk>` 1, then `pieces`."""
  lines = [f"{_yml_key(p)}: {i}" for i, p in enumerate(["</s>", "<unk>", *pieces])]
  return "\n".join(lines) + "\n"


def model_yml(v: Variant, vocab_size: int) -> dict:
  """A complete Marian config (pymarian takes defaults for missing keys silently)."""
  return {
    "type": "transformer",
    "dim-emb": v.d_model,
    "dim-vocabs": [vocab_size, vocab_size],
    "enc-depth": v.layers,
    "dec-depth": v.layers,
    "enc-cell": "gru",
    "dec-cell": "gru",
    "transformer-heads": v.heads,
    "transformer-dim-ffn": v.d_ff,
    "transformer-ffn-depth": 2,
    "transformer-decoder-dim-ffn": 0,
    "transformer-decoder-ffn-depth": 0,
    "transformer-ffn-activation": v.activation,
    "transformer-preprocess": "n" if v.pre_norm else "",
    "transformer-postprocess": "da" if v.pre_norm else "dan",
    "transformer-postprocess-emb": "d",
    "transformer-postprocess-top": "n" if v.pre_norm else "",
    "transformer-decoder-autoreg": "self-attention",
    "transformer-tied-layers": [],
    "transformer-guided-alignment-layer": "last",
    "transformer-no-projection": False,
    "transformer-train-position-embeddings": False,
    "transformer-depth-scaling": False,
    "transformer-dropout": 0.1,
    "transformer-dropout-attention": 0,
    "transformer-dropout-ffn": 0,
    "transformer-aan-depth": 2,
    "transformer-aan-activation": "swish",
    "transformer-aan-nogate": False,
    "transformer-dim-aan": 2048,
    "tied-embeddings": v.tied == "output",
    "tied-embeddings-all": v.tied == "all",
    "tied-embeddings-src": False,
    "layer-normalization": False,
    "right-left": False,
    "skip": False,
    "ulr": False,
    "lemma-dim-emb": 0,
    "output-omit-bias": False,
    "version": "v1.12.42",
  }


def config_array(config: dict, pad: bool) -> np.ndarray:
  """`special:model.yml`: the yml as int8 ending in NUL (padded with NULs to 256 bytes)."""
  data = yaml.safe_dump(config, sort_keys=True).encode("utf-8") + b"\0"
  if pad:
    data += b"\0" * (-len(data) % 256)
  return np.frombuffer(data, np.int8).copy()


def weights(v: Variant, vocab_size: int, seed: int) -> dict[str, np.ndarray]:
  """Random weights under Marian's names: kernels [in, out], biases and LayerNorms [1, n]."""
  rng = np.random.default_rng(seed)
  d, ff = v.d_model, v.d_ff
  out = {}

  def mat(name, rows, cols, scale=1.0):
    out[name] = (rng.standard_normal((rows, cols)) * scale / np.sqrt(rows)).astype(np.float32)

  def vec(name, n, mean=0.0, scale=0.1):
    out[name] = (mean + scale * rng.standard_normal((1, n))).astype(np.float32)

  def norm(prefix):
    suffix = "_pre" if v.pre_norm else ""
    vec(f"{prefix}_ln_scale{suffix}", d, 1.0)
    vec(f"{prefix}_ln_bias{suffix}", d)

  def attention(prefix):
    for x in "qkvo":
      scale = v.context_scale if "context" in prefix else v.sublayer_scale
      mat(f"{prefix}_W{x}", d, d, scale if x == "o" else 1.0)
      vec(f"{prefix}_b{x}", d)
    norm(f"{prefix}_Wo")

  def ffn(prefix):
    mat(f"{prefix}_W1", d, ff)
    vec(f"{prefix}_b1", ff)
    mat(f"{prefix}_W2", ff, d, v.sublayer_scale)
    vec(f"{prefix}_b2", d)
    norm(f"{prefix}_ffn")

  for i in range(1, v.layers + 1):
    attention(f"encoder_l{i}_self")
    ffn(f"encoder_l{i}_ffn")
    attention(f"decoder_l{i}_self")
    attention(f"decoder_l{i}_context")
    ffn(f"decoder_l{i}_ffn")
  if v.pre_norm:
    for stack in ("encoder", "decoder"):
      vec(f"{stack}_top_ln_scale", d, 1.0)
      vec(f"{stack}_top_ln_bias", d)
  emb_scale = v.emb_scale / np.sqrt(d)
  if v.tied == "all":
    out["Wemb"] = (rng.standard_normal((vocab_size, d)) * emb_scale).astype(np.float32)
  else:
    for stack in ("encoder", "decoder"):
      out[f"{stack}_Wemb"] = (rng.standard_normal((vocab_size, d)) * emb_scale).astype(np.float32)
    if v.tied == "none":
      out["decoder_ff_logit_out_Wt"] = (
        rng.standard_normal((vocab_size, d)) * v.logit_scale / np.sqrt(d)
      ).astype(np.float32)
  # Channel 2 of Marian's position table, sin(pos * 1e4^(-2/(d/2-1))), rises over ~20 positions.
  output = (
    "Wemb" if v.tied == "all" else {"output": "decoder_Wemb"}.get(v.tied, "decoder_ff_logit_out_Wt")
  )
  if v.eos_after:
    chosen = rng.permutation(np.arange(2, vocab_size))[: (vocab_size - 2) // 4]
    source = "Wemb" if v.tied == "all" else "decoder_Wemb"
    direction = out[source][chosen].sum(0)
    out[output][0] = v.eos_after * direction / np.linalg.norm(direction) * np.sqrt(d)
  if v.eos_ramp:
    for name in ("Wemb", "encoder_Wemb", "decoder_Wemb", "decoder_ff_logit_out_Wt"):
      if name in out:
        out[name][:, v.ramp_channel] = 0.0
    out[output][0, v.ramp_channel] = v.eos_ramp
  bias = 0.5 * rng.standard_normal((1, vocab_size))
  bias[0, 0] += v.eos_bias
  out["decoder_ff_logit_out_b"] = bias.astype(np.float32)
  return out


def write_release(folder, v: Variant = Variant(), seed: int = 0, spm_size: int = 60) -> dict:
  """Writes a tiny release into `folder`; returns {'pieces': the yml's pieces in id order,
  'config': the model yml}."""
  folder = pathlib.Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  texts = sentences(400, seed)
  source = train_spm(texts, spm_size, seed)
  target = train_spm(texts[::-1][:300], spm_size - 10, seed + 1)
  pieces = sorted(set(spm_pieces(source)) | set(spm_pieces(target)))
  vocab_size = len(pieces) + 2
  config = model_yml(v, vocab_size)
  arrays = weights(v, vocab_size, seed)
  arrays["special:model.yml"] = config_array(config, v.pad_config)
  np.savez(folder / "model.npz", **arrays)
  (folder / "vocab.yml").write_text(vocab_yml(pieces), encoding="utf-8")
  (folder / "source.spm").write_bytes(source)
  (folder / "target.spm").write_bytes(target)
  decoder = {
    "models": ["model.npz"],
    "vocabs": ["vocab.yml", "vocab.yml"],
    "beam-size": 4,
    "normalize": 1,
    "word-penalty": 0,
    "mini-batch": 16,
    "maxi-batch": 100,
    "maxi-batch-sort": "src",
    "relative-paths": True,
  }
  (folder / "decoder.yml").write_text(yaml.safe_dump(decoder), encoding="utf-8")
  return {"pieces": ["</s>", "<unk>", *pieces], "config": config}
