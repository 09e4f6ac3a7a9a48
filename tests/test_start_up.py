"""Decoding imports only what it needs: decode.py's module and `inference.Translator` import no
TensorFlow, TFDS, optimizer, plotting, TensorBoard or scoring library, nor the training loop;
loading a workdir and translating with a Translator neither (checked in a fresh interpreter, by
its `sys.modules`). CTranslate2's command line, the peer decoding is timed against, imports no
JAX or Flax at all."""

import json

import pytest

from tests.helpers import run_py

# Top-level packages and project modules decoding without references, plots or training must
# not import.
NOT_FOR_DECODING = (
  "tensorflow",
  "tensorflow_datasets",
  "optax",
  "matplotlib",
  "tensorboardX",
  "sacrebleu",
  "training.loop",
  "training.step",
  "training.state",
)
_NAMES = set(NOT_FOR_DECODING)
REPORT = (
  "import json, sys; print(json.dumps(sorted(m for m in sys.modules "
  f"if m.split('.')[0] in {_NAMES!r} or m in {_NAMES!r})))"
)


def _imported(*steps: str) -> list[list[str]]:
  """The modules of NOT_FOR_DECODING imported after each of `steps` (Python code run in turn in
  one fresh interpreter)."""
  out = run_py("-c", "\n".join(f"{step}\n{REPORT}" for step in steps))
  assert out.returncode == 0, out.stderr[-3000:]
  return [json.loads(line) for line in out.stdout.strip().splitlines()[-len(steps) :]]


def test_importing_decode_and_the_translator_imports_no_heavy_library():
  assert _imported("import decode\nfrom inference import Translator") == [[]]


def test_the_ctranslate2_command_line_imports_no_jax():
  # The peer's whole-process time must not carry JAX's import (about 0.7 s).
  out = run_py(
    "-c",
    "import json, sys, cli.ctranslate2_translate, inference.ctranslate2_translate\n"
    "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
    "('jax', 'jaxlib', 'flax', 'optax', 'orbax'))))",
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert json.loads(out.stdout.strip().splitlines()[-1]) == []


@pytest.mark.slow
def test_loading_and_translating_imports_no_heavy_library(decode_workdir):
  load = (
    "from inference import Translator\n"
    f"translator = Translator.load({str(decode_workdir)!r})\n"
    "translator.translate(['w1 w2 w3'], beam_size=2)"
  )
  translated, scored = _imported(load, "translator.metrics(['w1 w2'], ['w1 w2'])")
  assert translated == []
  # The check can fail: scoring against references is what imports sacreBLEU.
  assert scored and all(m.split(".")[0] == "sacrebleu" for m in scored), scored
