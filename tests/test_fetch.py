"""Multi30k fetched by the project (data/multi30k.py, data/download.py, `python -m cli.fetch`):
against a loopback HTTP server that stands in for the official repository, serving the reference
copy in ../shared/data/multi30k in the repository's layout (data/task1/raw/<split>.<lang>.gz),
with faults on demand. Nothing here leaves 127.0.0.1. Without ../shared (a user's clone) the
server serves made-up files of the same names whose digests the tests put in place of the real
ones, so that only the run of train.py on the real text skips."""

import gzip
import hashlib
import http.server
import json
import pathlib
import socket
import threading

import pytest

from configs.common import base_config
from core.errors import UsageError
from data import download, multi30k, sources
from tests.helpers import SHARED, one_device_env, run_in_process, run_py
from training.validate import check_config

RAW = "/mirror/data/task1/raw/"
FAST = dict(tries=2, backoff_s=0.0, timeout_s=10.0)


class Mirror:
  """A loopback HTTP server of `files` ({name: bytes}) at `<url>/data/task1/raw/<name>`.
  `faults[name]` lists what the next requests of `name` get, one each: 'cut' (half the body
  under the whole Content-Length, then the connection closes), 'corrupt' (one byte changed) or
  an HTTP status; `requests` lists the names asked for."""

  def __init__(self, files: dict[str, bytes]):
    self.files, self.faults, self.requests = files, {}, []
    mirror = self

    class Handler(http.server.BaseHTTPRequestHandler):
      def do_GET(self):
        name = self.path[len(RAW) :] if self.path.startswith(RAW) else self.path
        mirror.requests.append(name)
        if name not in mirror.files:
          self.send_error(404)
          return
        body = mirror.files[name]
        fault = mirror.faults[name].pop(0) if mirror.faults.get(name) else None
        if isinstance(fault, int):
          self.send_error(fault)
          return
        if fault == "corrupt":
          body = body[:-1] + bytes([body[-1] ^ 1])
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body[: len(body) // 2] if fault == "cut" else body)

      def log_message(self, *args):
        pass

    self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self.server.daemon_threads = True
    self.url = f"http://127.0.0.1:{self.server.server_address[1]}/mirror"
    self.thread = threading.Thread(
      target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    self.thread.start()

  def stop(self):
    self.server.shutdown()
    self.server.server_close()
    self.thread.join(timeout=10)


def _stand_in() -> dict[str, bytes]:
  """gzip files of made-up sentences named as Multi30k's val and test_2016_flickr."""
  files = {}
  for split, lines in (("val", 1014), ("test_2016_flickr", 1000)):
    for lang in multi30k.LANGUAGES:
      text = "".join(f"{lang} sentence {i} of {split}\n" for i in range(lines))
      files[multi30k.file_name(split, lang)] = gzip.compress(text.encode(), mtime=0)
  return files


@pytest.fixture
def reference(monkeypatch):
  """{name: bytes} of the files served: the reference copy in ../shared/data/multi30k, else
  made-up ones whose sha256 stand in for the real digests (in this process)."""
  folder = SHARED / "data" / "multi30k"
  if folder.is_dir():
    return {p.name: p.read_bytes() for p in folder.glob("*.gz")}
  files = _stand_in()
  for name, body in files.items():
    digest = download.Digest("sha256", hashlib.sha256(body).hexdigest())
    monkeypatch.setitem(multi30k.DIGESTS, name, digest)
  return files


@pytest.fixture
def mirror(reference, monkeypatch):
  monkeypatch.setenv("no_proxy", "127.0.0.1")  # a proxy of the environment must not take it
  server = Mirror(dict(reference))
  yield server
  server.stop()


def _closed_port() -> int:
  """A loopback port nothing listens on (bound, then released)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _left_in(folder: pathlib.Path) -> list[str]:
  return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_first_use_fetches_into_the_cache_then_reads_it_without_the_server(
  mirror, reference, tmp_path, monkeypatch, caplog
):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  caplog.set_level("INFO")
  paths = multi30k.local_files("val", ("en", "de"), mirror.url, **FAST)
  folder = tmp_path / "xdg" / "attention-jax" / "multi30k"
  assert paths == [folder / "val.en.gz", folder / "val.de.gz"]
  assert [p.read_bytes() for p in paths] == [reference["val.en.gz"], reference["val.de.gz"]]
  assert mirror.requests == ["val.en.gz", "val.de.gz"]
  assert f"downloading {mirror.url}/data/task1/raw/val.en.gz" in caplog.text  # the progress line
  assert _left_in(folder) == ["val.de.gz", "val.en.gz"]

  mirror.stop()  # any network access from now on would fail
  assert multi30k.local_files("val", ("en", "de"), mirror.url, **FAST) == paths
  config = base_config()
  config.data.update(name="multi30k", url=mirror.url, eval_split="val")
  pairs, stats = sources.load_split(config.data, "val")
  first = gzip.decompress(reference["val.en.gz"]).decode().splitlines()[0]
  assert stats.pairs == len(pairs) == 1014 and pairs[0][0] == first


def test_a_checksum_mismatch_discards_the_file_and_says_so(mirror, tmp_path):
  mirror.faults["val.en.gz"] = ["corrupt"]
  with pytest.raises(download.ChecksumError) as e:
    multi30k.local_files("val", ("en", "de"), mirror.url, tmp_path, **FAST)
  text = str(e.value)
  assert "\n" not in text
  assert f"{mirror.url}/data/task1/raw/val.en.gz" in text and "discarded" in text
  assert multi30k.DIGESTS["val.en.gz"].hexdigest in text
  assert mirror.requests == ["val.en.gz"]  # a wrong file is not fetched again
  assert _left_in(tmp_path) == []


def test_a_cached_file_that_does_not_match_is_fetched_again(mirror, reference, tmp_path, caplog):
  (tmp_path / "val.en.gz").write_bytes(b"not the file")
  multi30k.local_files("val", ("en", "de"), mirror.url, tmp_path, **FAST)
  assert (tmp_path / "val.en.gz").read_bytes() == reference["val.en.gz"]
  assert "discarded, fetching it again" in caplog.text


def test_server_down_is_one_line_with_the_url_the_reason_and_the_way_round(tmp_path):
  url = f"http://127.0.0.1:{_closed_port()}/mirror"
  with pytest.raises(download.DownloadError) as e:
    multi30k.local_files("val", ("en", "de"), url, tmp_path / "cache", **FAST)
  text = str(e.value)
  assert "\n" not in text
  assert text.startswith(f"cannot download {url}/data/task1/raw/val.en.gz: Connection refused")
  assert "(2 tries)" in text
  assert f"put val.en.gz and val.de.gz from {multi30k.REPOSITORY}/tree/{multi30k.COMMIT}" in text
  assert str(tmp_path / "cache") in text and "data.dir" in text
  assert _left_in(tmp_path / "cache") == []


def test_a_cut_download_never_counts_and_is_tried_again(mirror, reference, tmp_path):
  mirror.faults["val.en.gz"] = ["cut"]
  multi30k.local_files("val", ("en",), mirror.url, tmp_path, **FAST)
  assert mirror.requests == ["val.en.gz", "val.en.gz"]
  assert (tmp_path / "val.en.gz").read_bytes() == reference["val.en.gz"]

  mirror.faults["val.de.gz"] = ["cut", "cut"]
  size = len(reference["val.de.gz"])
  with pytest.raises(download.DownloadError, match=f"closed after {size // 2} of {size} bytes"):
    multi30k.local_files("val", ("de",), mirror.url, tmp_path, **FAST)
  assert _left_in(tmp_path) == ["val.en.gz"]  # no val.de.gz, no partial file


def test_a_busy_server_is_tried_again_a_missing_file_is_not(mirror, tmp_path):
  mirror.faults["val.en.gz"] = [503]
  multi30k.local_files("val", ("en",), mirror.url, tmp_path, **FAST)
  assert mirror.requests == ["val.en.gz", "val.en.gz"]
  with pytest.raises(download.DownloadError, match="HTTP 404"):
    multi30k.local_files("test_2017_flickr", ("en",), mirror.url, tmp_path, **FAST)
  assert mirror.requests[2:] == ["test_2017_flickr.en.gz"]


def test_every_split_has_a_digest_and_bad_names_fail_before_any_work():
  assert set(multi30k.DIGESTS) == {
    multi30k.file_name(s, lang) for s in multi30k.SPLITS for lang in multi30k.LANGUAGES
  }

  def multi30k_config(**data):
    config = base_config()
    config.data.update({"name": "multi30k", "eval_split": "val", **data})
    return config

  for field, value, words in (
    ("eval_split", "validation", "data.eval_split='validation' is not a Multi30k split"),
    ("source_lang", "fr", "language 'fr'"),
    ("url", "ftp://example.org", "not an http://, https:// or file:// URL"),
  ):
    with pytest.raises(UsageError, match=words):
      check_config(multi30k_config(**{field: value}), "train")
  check_config(multi30k_config(), "train")
  check_config(multi30k_config(dir="/somewhere", eval_split="validation"), "train")  # any names


def test_fetch_command_ahead_of_time_and_offline(mirror, reference, tmp_path, monkeypatch):
  monkeypatch.setattr(download, "BACKOFF_S", 0.0)
  out = tmp_path / "m30k"
  ok = run_in_process("cli.fetch", "multi30k", f"--to={out}", "--splits=val", f"--url={mirror.url}")
  assert ok.returncode == 0, ok.stderr
  assert f"--config.data.dir={out}" in ok.stdout
  assert (out / "val.de.gz").read_bytes() == reference["val.de.gz"]

  url = f"http://127.0.0.1:{_closed_port()}/mirror"
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # the default folder, empty
  down = run_in_process("cli.fetch", "multi30k", "--splits=test_2016_flickr", f"--url={url}")
  assert down.returncode == 1
  last = down.stderr.strip().splitlines()[-1]
  assert last.startswith(f"cli.fetch: error: cannot download {url}/data/task1/raw/")
  assert "Connection refused" in last and "data.dir" in last
  for args, words in (
    ((), "name the dataset first"),
    (("wmt14",), "unknown dataset 'wmt14'"),
    (("multi30k", "--splits=test"), "--splits='test' is not a Multi30k split"),
  ):
    bad = run_in_process("cli.fetch", *args)
    assert bad.returncode == 2 and bad.stderr.startswith("cli.fetch: error: "), bad.stderr
    assert words in bad.stderr and bad.stderr.count("\n") == 1


@pytest.mark.slow
def test_train_fetches_multi30k_on_first_use_and_runs_its_first_steps(
  shared_data, mirror, tmp_path
):
  """train.py with a Multi30k recipe, data.url at the server, an empty cache, a fresh workdir
  (the model and splits cut down so it runs in seconds). The real files: train.py checks them
  against the real digests."""
  workdir, xdg = tmp_path / "run", tmp_path / "xdg"
  proc = run_py(
    "train.py",
    "--config=configs/multi30k_transformer_tiny_ende.py",
    f"--workdir={workdir}",
    f"--config.data.url={mirror.url}",
    "--config.data.train_split=val",
    "--config.data.eval_split=test_2016_flickr",
    "--config.data.vocab_size=300",
    "--config.data.tokens_per_batch=512",
    "--config.model.d_model=32",
    "--config.model.d_ff=64",
    "--config.model.num_layers=1",
    "--config.num_train_steps=2",
    "--config.log_every_steps=1",
    "--config.eval.num_batches=1",
    "--config.eval.bleu_sentences=0",
    env=one_device_env(XDG_CACHE_HOME=str(xdg), no_proxy="127.0.0.1"),
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  folder = xdg / "attention-jax" / "multi30k"
  files = ["test_2016_flickr.de.gz", "test_2016_flickr.en.gz", "val.de.gz", "val.en.gz"]
  assert _left_in(folder) == files
  assert sorted(mirror.requests) == files
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records if r["split"] == "train"] == [1, 2]
