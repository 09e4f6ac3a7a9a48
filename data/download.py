"""One file fetched over the network: checked against its digest, written atomically, with
transient failures retried.

    download(url, path, Digest("sha256", "d79c..."))   # -> bytes written; raises DownloadError

The body goes to a temporary file beside `path` (`.<name>.<random>.part`), is hashed while it
arrives and replaces `path` (`os.replace`) only when it is whole (as many bytes as the server's
Content-Length) and its digest is the expected one: a cut transfer, a wrong file or an
interrupted process never leaves `path` half-written, and the temporary file is removed whatever
happens. Refused or reset connections, timeouts, cut transfers and HTTP 408 / 429 / 5xx are tried
again, `tries` times in all, `backoff_s`, then twice that, ... apart; another HTTP status (403,
404, ...), a file:// path that is not there and a digest mismatch are final. URLs: `http://`,
`https://`, `file://`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import http.client
import os
import pathlib
import time
import urllib.error
import urllib.request
import uuid

from absl import logging

from core.errors import RunError

TRIES = 3
BACKOFF_S = 0.5
TIMEOUT_S = 30.0
RETRIED_HTTP_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_CHUNK = 1 << 16


@dataclasses.dataclass(frozen=True)
class Digest:
  """The expected hash of a file: `algorithm` a hashlib name ('sha256', 'md5'), `hexdigest`."""

  algorithm: str
  hexdigest: str

  def of_file(self, path: str | os.PathLike) -> str:
    """The hex digest of the file at `path` under this algorithm."""
    h = hashlib.new(self.algorithm)
    with open(path, "rb") as f:
      while chunk := f.read(1 << 20):
        h.update(chunk)
    return h.hexdigest()

  def __str__(self) -> str:
    return f"{self.algorithm}:{self.hexdigest}"


class DownloadError(RunError):
  """A file could not be fetched (a failure while running: exit status 1)."""


class ChecksumError(DownloadError):
  """What arrived is not the expected file; it was discarded."""


class _Transient(Exception):
  """A failure worth another try; its text is the reason."""


def download(
  url: str,
  path: str | os.PathLike,
  digest: Digest,
  *,
  tries: int | None = None,
  backoff_s: float | None = None,
  timeout_s: float | None = None,
) -> int:
  """Fetches `url` into `path` (its folder created), checked against `digest`; returns its size.
  `tries`, `backoff_s`, `timeout_s`: default this module's TRIES, BACKOFF_S, TIMEOUT_S.

  Raises:
    DownloadError: every try failed (the message names the URL, the last reason and the number
      of tries), or the server refused it for good (an HTTP status that is not retried).
    ChecksumError: the file arrived whole but its digest is not `digest`; nothing was kept.
    OSError: `path`'s folder cannot be written.
  """
  tries = TRIES if tries is None else tries
  backoff_s = BACKOFF_S if backoff_s is None else backoff_s
  timeout_s = TIMEOUT_S if timeout_s is None else timeout_s
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  logging.info("downloading %s -> %s", url, path)
  reason = ""
  for attempt in range(1, tries + 1):
    try:
      size = _download_once(url, path, digest, timeout_s)
    except _Transient as e:
      reason = str(e)
      if attempt < tries:
        delay = backoff_s * 2 ** (attempt - 1)
        logging.warning(
          "%s: %s; trying again in %.1f s (try %d of %d)", url, reason, delay, attempt + 1, tries
        )
        time.sleep(delay)
      continue
    logging.info("%s: %d bytes, %s as expected", path, size, digest.algorithm)
    return size
  raise DownloadError(
    f"cannot download {url}: {reason} ({tries} {'try' if tries == 1 else 'tries'})"
  )


def _download_once(url: str, path: pathlib.Path, digest: Digest, timeout_s: float) -> int:
  # A name of its own per writer (processes of one job may fetch at once); unlike tempfile's
  # 0600, the file's mode follows the umask, so a cache on a shared disk serves the team.
  part = path.with_name(f".{path.name}.{uuid.uuid4().hex}.part")
  try:
    with open(os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as out:
      got, size = _copy(url, out, hashlib.new(digest.algorithm), timeout_s)
      out.flush()
      os.fsync(out.fileno())
    if got != digest.hexdigest:
      raise ChecksumError(
        f"{url}: the file that arrived has {digest.algorithm} {got}, not the expected "
        f"{digest.hexdigest}: discarded (a wrong file at that URL, or a mirror that differs)"
      )
    os.replace(part, path)
    return size
  except BaseException:  # a failure, Ctrl-C or SIGTERM mid-transfer: nothing half-written stays
    part.unlink(missing_ok=True)
    raise


def _copy(url: str, out, hasher, timeout_s: float) -> tuple[str, int]:
  """Writes the body of `url` to `out`; returns (its hex digest, its size)."""
  request = urllib.request.Request(url, headers={"User-Agent": "attention-jax"})
  try:
    response = urllib.request.urlopen(request, timeout=timeout_s)
  except urllib.error.HTTPError as e:
    status = f"HTTP {e.code} {e.reason}".strip()
    if e.code in RETRIED_HTTP_STATUS:
      raise _Transient(status) from None
    raise DownloadError(f"cannot download {url}: {status}") from None
  except urllib.error.URLError as e:  # refused, no route, name not resolved, ...
    if isinstance(e.reason, (FileNotFoundError, PermissionError, IsADirectoryError)):  # file://
      raise DownloadError(f"cannot download {url}: {_reason(e.reason)}") from None
    raise _Transient(_reason(e.reason)) from None
  except (OSError, http.client.HTTPException) as e:  # a timeout or reset before the body
    raise _Transient(_reason(e)) from None
  with response:
    expected = response.headers.get("Content-Length")
    size = 0
    while chunk := _read(response):
      out.write(chunk)  # a local write error (disk full) is no network failure: not retried
      hasher.update(chunk)
      size += len(chunk)
  if expected is not None and expected.isdigit() and size != int(expected):
    raise _Transient(f"the connection closed after {size} of {expected} bytes")
  return hasher.hexdigest(), size


def _read(response) -> bytes:
  try:
    return response.read(_CHUNK)
  except (OSError, http.client.HTTPException) as e:  # reset or timed out mid-body
    raise _Transient(_reason(e)) from None


def _reason(error) -> str:
  """What went wrong, in a few words: an OSError's own text ('Connection refused'), else the
  exception's text or type."""
  if isinstance(error, BaseException):
    if isinstance(error, OSError) and error.strerror:
      return error.strerror
    if isinstance(error, TimeoutError):
      return "timed out"
    if isinstance(error, http.client.IncompleteRead):
      return f"the connection closed after {len(error.partial)} bytes"
    return str(error) or type(error).__name__
  return str(error)
