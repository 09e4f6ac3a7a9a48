"""benchmark/flax_wmt.py: loading google/flax examples/wmt next to this repository's own top-level
`train.py` / `decode.py` (same module names). Uses a stand-in directory with the example's import
structure; the real example is timed by `bench.py --flax_wmt=<dir>` (docs/results.md)."""

import importlib.util
import sys
import types

import pytest

from benchmark import flax_wmt
from core.errors import UsageError

THEIR_TRAIN = """
import clu.metric_writers        # pipeline-only imports: stood in for when not installed
import tensorflow_text
import decode
import models
WHO = "flax train"
"""


@pytest.fixture
def wmt_dir(tmp_path):
  (tmp_path / "train.py").write_text(THEIR_TRAIN)
  (tmp_path / "models.py").write_text("WHO = 'flax models'\n")
  (tmp_path / "decode.py").write_text("WHO = 'flax decode'\n")
  return tmp_path


def test_load_does_not_shadow_our_modules(wmt_dir, monkeypatch):
  ours = types.ModuleType("decode")
  monkeypatch.setitem(sys.modules, "decode", ours)
  monkeypatch.delitem(sys.modules, "train", raising=False)
  wmt = flax_wmt.load(str(wmt_dir))
  assert (wmt.train.WHO, wmt.models.WHO, wmt.decode.WHO) == (
    "flax train",
    "flax models",
    "flax decode",
  )
  assert sys.modules["decode"] is ours  # restored
  assert "train" not in sys.modules and "models" not in sys.modules
  assert str(wmt_dir) not in sys.path
  for name in ("clu", "clu.metric_writers", "tensorflow_text"):  # stand-ins removed again
    if importlib.util.find_spec(name.split(".")[0]) is None:
      assert name not in sys.modules


def test_not_a_wmt_directory(tmp_path):
  (tmp_path / "train.py").write_text("")
  with pytest.raises(UsageError, match=r"no models\.py, decode\.py"):
    flax_wmt.load(str(tmp_path))


def test_import_error_names_the_directory(wmt_dir):
  (wmt_dir / "train.py").write_text("import no_such_module_here\n")
  with pytest.raises(UsageError, match="importing its train.py failed"):
    flax_wmt.load(str(wmt_dir))


def test_only_the_transformer(wmt_dir):
  from configs import multi30k_rnn

  with pytest.raises(UsageError, match="has only the transformer"):
    flax_wmt.model_config(flax_wmt.load(str(wmt_dir)), multi30k_rnn.get_config().model)


def test_pmap_devices_follow_num_devices():
  """flax's pmap runs on the devices bench times ours on (config.num_devices), not on all of
  this host's (8 simulated here)."""
  import jax

  from configs import tiny

  config = tiny.get_config()
  assert len(jax.local_devices()) == 8
  assert flax_wmt.pmap_devices(config, 16) == jax.local_devices()  # 0 = all
  config.num_devices = 1
  assert flax_wmt.pmap_devices(config, 3) == jax.local_devices()[:1]
  config.num_devices = 2
  assert flax_wmt.pmap_devices(config, 4) == jax.local_devices()[:2]
  with pytest.raises(
    UsageError,
    match=r"bench.batch_size=3 is not divisible by the 2 "
    r"devices flax's pmap splits it over \(num_devices=2",
  ):
    flax_wmt.pmap_devices(config, 3)
  config.num_devices = 9
  with pytest.raises(UsageError, match="num_devices=9, but this process has 8"):
    flax_wmt.pmap_devices(config, 9)
