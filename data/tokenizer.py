"""Vocabularies: text <-> token ids, with special ids fixed across the whole project.

Two kinds, both behind the same `Vocab` interface:

* `SentencePieceVocab`: a shared source/target unigram model (`<workdir>/vocab.model`), trained
  in-process by `train_sentencepiece` on the training text when no model exists yet.
* `WordVocab`: a fixed word-level vocabulary (`<workdir>/vocab.json`) for the built-in synthetic
  task.

`load_vocab(path)` opens either kind by file suffix.
"""

from __future__ import annotations

import abc
import base64
import hashlib
import io
import json
import os
import pathlib
import uuid
from collections.abc import Callable, Iterable, Sequence

import numpy as np
from absl import logging

from core.errors import first_line
from model.special_tokens import EOS_ID, NUM_SPECIAL, PAD_ID, SEP_ID, SPECIAL_PIECES, UNK_ID

SEP_PIECE = SPECIAL_PIECES[SEP_ID]

VOCAB_MODEL_NAME = "vocab.model"  # SentencePiece model file name inside a workdir
VOCAB_JSON_NAME = "vocab.json"  # WordVocab file name inside a workdir


class Vocab(abc.ABC):
  """A mapping between text and token ids with PAD/EOS/UNK/SEP at ids 0/1/2/3."""

  @property
  @abc.abstractmethod
  def vocab_size(self) -> int:
    """Number of ids, specials included; every id is in `[0, vocab_size)`."""

  @property
  @abc.abstractmethod
  def fingerprint(self) -> str:
    """Short stable string identifying this vocabulary (used to key token-id caches)."""

  @abc.abstractmethod
  def encode(self, text: str) -> list[int]:
    """Token ids of `text`, without EOS."""

  @abc.abstractmethod
  def piece(self, token_id: int) -> str | None:
    """The piece or word of one id (specials included), or None for an id it has none for."""

  @abc.abstractmethod
  def _decode_clean(self, ids: list[int]) -> str:
    """Text of ids that contain no EOS and no PAD."""

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    """Text of `ids` (`[length]`), read up to the first EOS; PAD ids are dropped."""
    ids = [int(i) for i in np.asarray(ids).reshape(-1)]
    if EOS_ID in ids:
      ids = ids[: ids.index(EOS_ID)]
    return self._decode_clean([i for i in ids if i != PAD_ID])

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    """`encode` of each text."""
    return [self.encode(t) for t in texts]

  def encode_target(self, text: str) -> list[int]:
    """Token ids of a target-side `text`, without EOS: `encode`'s, unless the vocabulary has
    its own target segmenter (`MarianVocab`)."""
    return self.encode(text)

  def encode_target_batch(self, texts: Sequence[str]) -> list[list[int]]:
    """`encode_target` of each text."""
    return [self.encode_target(t) for t in texts]

  def decode_batch(self, ids: np.ndarray | Sequence[Sequence[int]]) -> list[str]:
    """`decode` of each row of `ids` (`[batch, length]`)."""
    return [self.decode(row) for row in ids]


def _atomic_write(path: pathlib.Path, data: bytes) -> None:
  """Writes `data` to `path` via a temporary file in the same folder and a rename. The file's
  mode follows the umask, as `open`'s does (tempfile's would be 0600: a workdir that another user
  could not decode)."""
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
  try:
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as f:
      f.write(data)
    os.replace(tmp, path)
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise


class SentencePieceVocab(Vocab):
  """A SentencePiece model whose special ids follow this project's convention."""

  def __init__(self, model_proto: bytes, name: str = "<in memory>"):
    import sentencepiece as spm

    self._proto = model_proto
    self._sp = spm.SentencePieceProcessor()
    try:
      self._sp.LoadFromSerializedProto(model_proto)
    except (RuntimeError, OSError) as e:
      raise ValueError(f"{name} is not a valid SentencePiece model: {e}") from e
    sp = self._sp
    found = (sp.pad_id(), sp.eos_id(), sp.unk_id(), sp.piece_to_id(SEP_PIECE))
    if found != (PAD_ID, EOS_ID, UNK_ID, SEP_ID):
      raise ValueError(
        f"{name}: SentencePiece model has pad/eos/unk/{SEP_PIECE} ids {found}; this project needs "
        f"{(PAD_ID, EOS_ID, UNK_ID, SEP_ID)} (train it with train_sentencepiece)"
      )

  @classmethod
  def load(cls, path: str | os.PathLike) -> SentencePieceVocab:
    """Reads a `.model` file."""
    return cls(pathlib.Path(path).read_bytes(), name=str(path))

  def save(self, path: str | os.PathLike) -> None:
    """Writes the model file atomically."""
    _atomic_write(pathlib.Path(path), self._proto)

  @property
  def vocab_size(self) -> int:
    return self._sp.vocab_size()

  @property
  def fingerprint(self) -> str:
    return "spm-" + hashlib.sha256(self._proto).hexdigest()[:16]

  def encode(self, text: str) -> list[int]:
    return self._sp.encode(text)

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return self._sp.encode(list(texts), num_threads=os.cpu_count() or 1)

  def piece(self, token_id: int) -> str | None:
    return self._sp.id_to_piece(token_id) if 0 <= token_id < self._sp.get_piece_size() else None

  def _decode_clean(self, ids: list[int]) -> str:
    # An id with no piece (a model whose vocab_size exceeds this vocabulary) reads as <unk>;
    # SentencePiece itself raises IndexError on it.
    size = self._sp.vocab_size()
    return self._sp.decode([i if 0 <= i < size else UNK_ID for i in ids])


def train_sentencepiece(
  texts: Iterable[str],
  vocab_size: int,
  model_path: str | os.PathLike,
  *,
  max_sentences: int = 1_000_000,
  seed: int = 0,
) -> SentencePieceVocab:
  """Trains a unigram SentencePiece model on `texts` and writes it atomically to `model_path`.

  Args:
    texts: sentences (source and target sides together for a shared vocabulary).
    vocab_size: wanted number of pieces, specials included; a corpus too small for it gets fewer.
    model_path: where the `.model` file goes.
    max_sentences: at most this many sentences, sampled uniformly, are used for training.
    seed: seed of that sample.
  """
  import sentencepiece as spm

  # SentencePiece wraps an exception raised by the iterator in a RuntimeError; keep the original.
  raised: list[BaseException] = []

  def sentences():
    try:
      yield from texts
    except Exception as e:  # noqa: BLE001 - re-raised below
      raised.append(e)
      raise

  model = io.BytesIO()
  spm.set_random_generator_seed(seed)
  try:
    spm.SentencePieceTrainer.train(
      sentence_iterator=sentences(),
      model_writer=model,
      vocab_size=vocab_size,
      model_type="unigram",
      pad_id=PAD_ID,
      eos_id=EOS_ID,
      unk_id=UNK_ID,
      bos_id=-1,
      user_defined_symbols=[SEP_PIECE],
      character_coverage=1.0,
      input_sentence_size=max_sentences,
      shuffle_input_sentence=True,
      hard_vocab_limit=False,
      num_threads=os.cpu_count() or 1,
      minloglevel=2,
    )
  except RuntimeError:
    if raised:
      raise raised[0] from None
    raise
  vocab = SentencePieceVocab(model.getvalue(), name=str(model_path))
  vocab.save(model_path)
  logging.info("Trained a SentencePiece vocabulary of %d pieces: %s", vocab.vocab_size, model_path)
  return vocab


class _JsonVocab(Vocab):
  """A vocabulary stored as one JSON file (`to_json`, with its "kind"), fingerprinted by it."""

  KIND: str

  @abc.abstractmethod
  def to_json(self) -> str: ...

  def save(self, path: str | os.PathLike) -> None:
    """Writes the vocabulary as JSON, atomically."""
    _atomic_write(pathlib.Path(path), self.to_json().encode("utf-8"))

  @property
  def fingerprint(self) -> str:
    return f"{self.KIND}-" + hashlib.sha256(self.to_json().encode("utf-8")).hexdigest()[:16]


class WordVocab(_JsonVocab):
  """A fixed word-level vocabulary: word `i` of `words` has id `NUM_SPECIAL + i`.

  Text is split on whitespace; words not in the list encode to UNK_ID.
  """

  KIND = "word"

  def __init__(self, words: Sequence[str]):
    self.words = list(words)
    self._ids = {w: NUM_SPECIAL + i for i, w in enumerate(self.words)}
    if len(self._ids) != len(self.words):
      raise ValueError("WordVocab words must be distinct")
    self._pieces = list(SPECIAL_PIECES) + self.words

  def to_json(self) -> str:
    return json.dumps({"kind": self.KIND, "words": self.words})

  @classmethod
  def load(cls, path: str | os.PathLike) -> WordVocab:
    """Reads a file written by `save`."""
    try:
      spec = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
      if spec.get("kind") != "word":
        raise ValueError('missing "kind": "word"')
      return cls(spec["words"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
      raise ValueError(f"{path} is not a valid WordVocab JSON file: {e}") from e

  @property
  def vocab_size(self) -> int:
    return len(self._pieces)

  def encode(self, text: str) -> list[int]:
    return [self._ids.get(w, UNK_ID) for w in text.split()]

  def piece(self, token_id: int) -> str | None:
    return self._pieces[token_id] if 0 <= token_id < len(self._pieces) else None

  def _decode_clean(self, ids: list[int]) -> str:
    return " ".join(
      self._pieces[i] if 0 <= i < len(self._pieces) else self._pieces[UNK_ID] for i in ids
    )


class MarianVocab(_JsonVocab):
  """An imported model's vocabulary (formats/marian.py): one id map over separate source and
  target SentencePiece models, as Marian / OPUS-MT releases ship them (`source.spm`,
  `target.spm`, a `*.vocab.yml` of pieces).

  `pieces[i]` is the piece of id i; ids 0-3 are this project's PAD/EOS/UNK/SEP (Marian's `</s>`
  and `<unk>` are EOS and UNK, PAD and SEP are rows Marian has not). Text is segmented into
  pieces by the source model (`encode`) or the target model (`encode_target`), then looked up
  (a piece not in the map is UNK), as OPUS-MT's preprocess.sh and Marian's vocabulary do;
  decoding joins the pieces and turns '▁' into spaces, as OPUS-MT's postprocess.sh. Stored as
  one JSON file (`vocab.json`, "kind": "marian") holding the pieces and both models.
  """

  KIND = "marian"

  def __init__(self, pieces: Sequence[str], source_spm: bytes, target_spm: bytes):
    import sentencepiece as spm

    self.pieces = list(pieces)
    if tuple(self.pieces[:NUM_SPECIAL]) != SPECIAL_PIECES:
      raise ValueError(f"MarianVocab: the first pieces must be {SPECIAL_PIECES}")
    self._ids = {p: i for i, p in enumerate(self.pieces) if i >= EOS_ID}
    if len(self._ids) != len(self.pieces) - 1:
      raise ValueError("MarianVocab: pieces must be distinct")
    self._protos = (bytes(source_spm), bytes(target_spm))
    self._sp = []
    for side, proto in zip(("source", "target"), self._protos):
      sp = spm.SentencePieceProcessor()
      try:
        sp.LoadFromSerializedProto(proto)
      except (RuntimeError, OSError) as e:
        raise ValueError(f"{side}.spm is not a valid SentencePiece model: {e}") from e
      self._sp.append(sp)

  def to_json(self) -> str:
    return json.dumps(
      {
        "kind": self.KIND,
        "pieces": self.pieces,
        "source_spm": base64.b64encode(self._protos[0]).decode("ascii"),
        "target_spm": base64.b64encode(self._protos[1]).decode("ascii"),
      },
      ensure_ascii=False,
    )

  @classmethod
  def from_spec(cls, spec: dict) -> MarianVocab:
    return cls(
      spec["pieces"],
      base64.b64decode(spec["source_spm"], validate=True),
      base64.b64decode(spec["target_spm"], validate=True),
    )

  @property
  def vocab_size(self) -> int:
    return len(self.pieces)

  def _lookup(self, pieces: Sequence[str]) -> list[int]:
    return [self._ids.get(p, UNK_ID) for p in pieces]

  def encode(self, text: str) -> list[int]:
    return self._lookup(self._sp[0].encode(text, out_type=str))

  def encode_target(self, text: str) -> list[int]:
    return self._lookup(self._sp[1].encode(text, out_type=str))

  def piece(self, token_id: int) -> str | None:
    return self.pieces[token_id] if 0 <= token_id < len(self.pieces) else None

  def _decode_clean(self, ids: list[int]) -> str:
    unk = self.pieces[UNK_ID]
    text = "".join(self.pieces[i] if 0 <= i < len(self.pieces) else unk for i in ids)
    return text.replace("\u2581", " ").strip()


def encode_source(
  vocab: Vocab, text: str, max_len: int, target: bool = False
) -> tuple[list[int], bool]:
  """(the ids a model reads for the source `text`: its tokens, cut to `max_len - 1` when longer,
  then EOS, at most `max_len` ids; whether it was cut). Translation and evaluation encode with
  this; training data is cut or dropped by data/token_cache.py, as `data.truncate` says."""
  tokens = list(vocab.encode_target(text) if target else vocab.encode(text))
  return tokens[: max_len - 1] + [EOS_ID], len(tokens) + 1 > max_len


def warn_cut(lines: Sequence[int], count: int, max_len: int, limit: int = 20) -> None:
  """Logs which of `count` sources, by line number (`lines`), `encode_source` cut to `max_len`;
  nothing when none was."""
  if not lines:
    return
  shown = ", ".join(map(str, lines[:limit]))
  more = f" and {len(lines) - limit} more" if len(lines) > limit else ""
  logging.warning(
    "%d of %d sentences are longer than model.max_len=%d tokens (EOS included) and were "
    "truncated to it: line %s%s",
    len(lines),
    count,
    max_len,
    shown,
    more,
  )


def workdir_name(vocab: Vocab) -> str:
  """The file name a vocabulary of this kind has inside a workdir."""
  return VOCAB_JSON_NAME if isinstance(vocab, (WordVocab, MarianVocab)) else VOCAB_MODEL_NAME


def save_in_workdir(vocab: Vocab, workdir: str | os.PathLike) -> pathlib.Path:
  """Copies `vocab` (e.g. one read from `data.vocab_path`) into the workdir, so that the workdir
  alone decodes on another machine; rewrites the file only when it holds another vocabulary."""
  path = pathlib.Path(workdir) / workdir_name(vocab)
  if not (path.is_file() and load_vocab(path).fingerprint == vocab.fingerprint):
    vocab.save(path)
  return path


def load_vocab(path: str | os.PathLike) -> Vocab:
  """Opens a vocabulary file: `.model` -> `SentencePieceVocab`, `.json` -> `WordVocab`."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"vocabulary file {path} does not exist")
  if path.suffix == ".model":
    return SentencePieceVocab.load(path)
  if path.suffix == ".json":
    try:
      kind = json.loads(path.read_text(encoding="utf-8")).get("kind")
    except (ValueError, AttributeError, UnicodeDecodeError) as e:
      raise ValueError(f"{path} is not a valid vocabulary JSON file: {e}") from e
    if kind == MarianVocab.KIND:
      try:
        return MarianVocab.from_spec(json.loads(path.read_text(encoding="utf-8")))
      except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a valid Marian vocabulary JSON file: {e}") from e
    return WordVocab.load(path)
  raise ValueError(
    f"vocabulary file {path}: unknown suffix {path.suffix!r} (expected .model or .json)"
  )


def run_vocab_files(workdir, data_config) -> list[pathlib.Path]:
  """The existing files a run's vocabulary may be in, in the order to try them: the workdir's
  vocab.model / vocab.json (training copies data.vocab_path there), then data.vocab_path."""
  workdir = pathlib.Path(workdir)
  paths = [workdir / name for name in (VOCAB_MODEL_NAME, VOCAB_JSON_NAME)]
  if data_config.get("vocab_path"):
    paths.append(pathlib.Path(data_config.vocab_path))
  return [path for path in paths if path.is_file()]


def load_matching(paths, fingerprint: str | None) -> tuple[Vocab | None, list[str]]:
  """(the vocabulary of the first readable file of `paths` whose fingerprint is `fingerprint`,
  any for None; or None) and, for each file passed over, 'path: fingerprint' or 'path: unreadable
  (reason)': to find the vocabulary a checkpoint recorded."""
  passed = []
  for path in paths:
    try:
      vocab = load_vocab(path)
    except Exception as e:  # noqa: BLE001 - a damaged or stale file: try the next one
      passed.append(f"{path}: unreadable ({first_line(e)})")
      continue
    if fingerprint is None or vocab.fingerprint == fingerprint:
      return vocab, passed
    passed.append(f"{path}: {vocab.fingerprint}")
  return None, passed


def load_or_train_vocab(
  config_data, workdir: str | os.PathLike, texts_fn: Callable[[], Iterable[str]]
) -> Vocab:
  """The vocabulary for a run.

  In order: `config_data.vocab_path` when set; else `<workdir>/vocab.model` when it exists (a
  resumed run, or decoding); else a new SentencePiece model of `config_data.vocab_size` pieces
  trained on `texts_fn()` and saved as `<workdir>/vocab.model`.
  """
  if config_data.vocab_path:
    return load_vocab(config_data.vocab_path)
  path = pathlib.Path(workdir) / VOCAB_MODEL_NAME
  if path.exists():
    vocab = load_vocab(path)
    # A corpus too small for data.vocab_size gets fewer pieces, so only more is certainly
    # another setting; fewer is worth a warning (resumes also compare data.vocab_size).
    if vocab.vocab_size > int(config_data.vocab_size):
      raise ValueError(
        f"{path} has {vocab.vocab_size} pieces, more than data.vocab_size="
        f"{config_data.vocab_size}: use a new workdir for another vocabulary (or the old "
        f"setting to continue with this one)"
      )
    if vocab.vocab_size < int(config_data.vocab_size):
      logging.warning(
        "reusing %s: %d pieces, fewer than data.vocab_size=%d (a small corpus, "
        "or a vocabulary made for another setting: then use a new workdir)",
        path,
        vocab.vocab_size,
        config_data.vocab_size,
      )
    return vocab
  logging.info("No vocabulary at %s: training one of size %d", path, config_data.vocab_size)
  return train_sentencepiece(texts_fn(), config_data.vocab_size, path)
