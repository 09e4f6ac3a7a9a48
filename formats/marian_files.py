"""A Marian / OPUS-MT release's files, read as untrusted input: a folder or a zip read member by
member into memory (never extracted; a member whose name leaves its folder, or a link, refuses the
release), npz arrays loaded with `allow_pickle=False`, yml read with a safe loader (the vocabulary's
with every scalar a string). What cannot be read is one line, a `MarianError` naming the file.

    release = read_release("opus-mt-en-de.zip")            # {file name: bytes}
    arrays = read_npz(release["opus.npz"], "opus.npz")      # {weight name: array}
    options = model_config(arrays, "opus.npz")              # the `special:model.yml` options
    pieces = read_vocab_yml(release["opus.vocab.yml"], "opus.vocab.yml")   # by Marian id
"""

from __future__ import annotations

import io
import pathlib
import stat
import zipfile
from typing import Any

import numpy as np
import yaml

from core.errors import UsageError
from model.special_tokens import SPECIAL_PIECES

MODEL_YML = "special:model.yml"  # the npz entry holding the model's options


class MarianError(UsageError):
  """A release that cannot be imported exactly: one line naming the file and what is wrong."""


def read_release(model) -> dict[str, bytes]:
  """{file name: bytes} of a release folder or zip (its top-level files, or those of its one
  folder). MarianError for a missing path, an unreadable zip, or a member that is a link or whose
  name is absolute or climbs out of its folder."""
  path = pathlib.Path(model)
  if path.is_dir():
    files = {}
    for p in sorted(path.iterdir()):
      if p.is_symlink():
        continue  # a link may point anywhere: not part of the release
      if p.is_file():
        files[p.name] = p.read_bytes()
    return files
  if not path.is_file():
    raise MarianError(f"model={str(path)!r}: no such folder or zip file")
  try:
    with zipfile.ZipFile(path) as zf:
      infos = zf.infolist()
      for info in infos:
        _check_member(path, info)
      members = [i for i in infos if not i.is_dir()]
      folders = {pathlib.PurePosixPath(i.filename).parent for i in members}
      if len(folders) > 1 and pathlib.PurePosixPath(".") in folders:
        members = [i for i in members if "/" not in i.filename.rstrip("/")]
      return {pathlib.PurePosixPath(i.filename).name: zf.read(i) for i in members}
  except (zipfile.BadZipFile, OSError, EOFError) as e:
    raise MarianError(f"{path}: not a readable zip file ({e})") from None


def _check_member(path, info: zipfile.ZipInfo) -> None:
  name = info.filename
  parts = pathlib.PurePosixPath(name.replace("\\", "/")).parts
  if name.startswith(("/", "\\")) or ".." in parts or (parts and ":" in parts[0]):
    raise MarianError(f"{path}: member {name!r} would leave the release's folder; refused")
  if stat.S_ISLNK(info.external_attr >> 16):
    raise MarianError(f"{path}: member {name!r} is a link; refused")


# libyaml's parser where PyYAML has it (the same documents, several times faster on a vocabulary
# of tens of thousands of pieces), else PyYAML's own; safe constructors either way.
_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _StringLoader(_SafeLoader):
  """yaml's safe loader with every plain scalar read as a string (no bools, numbers or dates):
  a vocabulary piece such as `yes` or `1` stays the piece it is."""


_StringLoader.yaml_implicit_resolvers = {}


def yaml_document(data: bytes, name: str, strings: bool = False) -> Any:
  try:
    text = data.decode("utf-8")
    return yaml.load(text, Loader=_StringLoader if strings else _SafeLoader)
  except (UnicodeDecodeError, yaml.YAMLError) as e:
    reason = " ".join(str(e).split())
    raise MarianError(f"{name}: not readable YAML ({reason[:160]})") from None


def read_npz(data: bytes, name: str) -> dict[str, np.ndarray]:
  """The arrays of an npz file, loaded without pickle; MarianError when it is not one."""
  try:
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
      if not hasattr(npz, "files"):
        raise ValueError("a single array, not an npz archive")
      return {key: np.asarray(npz[key]) for key in npz.files}
  except (ValueError, OSError, EOFError, zipfile.BadZipFile, KeyError) as e:
    raise MarianError(f"{name}: not a readable npz file ({_one_line(e)})") from None


def _one_line(e: Exception) -> str:
  return " ".join(str(e).split())[:200]


def model_config(arrays: dict[str, np.ndarray], name: str) -> dict:
  """The options Marian stored in the npz (`special:model.yml`, text up to the first NUL)."""
  if MODEL_YML not in arrays:
    raise MarianError(f"{name}: no {MODEL_YML!r} entry (not a Marian model)")
  raw = np.asarray(arrays[MODEL_YML])
  if raw.dtype.kind not in "iub":
    raise MarianError(f"{name}: {MODEL_YML!r} is {raw.dtype}, not bytes")
  text = raw.astype(np.uint8).tobytes().split(b"\0", 1)[0]
  config = yaml_document(text, f"{name}:{MODEL_YML}")
  if not isinstance(config, dict):
    raise MarianError(f"{name}: {MODEL_YML!r} is not a mapping of options")
  return config


def read_vocab_yml(data: bytes, name: str) -> list[str]:
  """The pieces of a Marian `*.vocab.yml`, by Marian id (0 `</s>`, 1 `<unk>`)."""
  mapping = yaml_document(data, name, strings=True)
  if not isinstance(mapping, dict) or not mapping:
    raise MarianError(f"{name}: not a mapping of pieces to ids")
  by_id = {}
  for piece, index in mapping.items():
    try:
      index = int(index)
    except (TypeError, ValueError):
      raise MarianError(f"{name}: piece {piece!r} has id {index!r}, not an integer") from None
    if not isinstance(piece, str) or index in by_id:
      raise MarianError(f"{name}: id {index} is given twice")
    by_id[index] = piece
  if sorted(by_id) != list(range(len(by_id))):
    raise MarianError(f"{name}: ids are not 0..{len(by_id) - 1}")
  pieces = [by_id[i] for i in range(len(by_id))]
  if pieces[:2] != ["</s>", "<unk>"]:
    raise MarianError(f"{name}: ids 0 and 1 are {pieces[:2]}, expected ['</s>', '<unk>']")
  if set(pieces[2:]) & set(SPECIAL_PIECES):
    clash = sorted(set(pieces[2:]) & set(SPECIAL_PIECES))[0]
    raise MarianError(f"{name}: piece {clash!r} is one of this project's special pieces")
  return pieces
