"""The command lines' shared behaviour (cli/, core/rules.py, training/validate.py): every config
field and number flag checked for type and range before any work, one-line errors with the exit
status of their kind (library errors naming Python arguments printed as flags), `--show_config`,
config files that cannot be loaded, and the logging policy (core/logs.py)."""

import dataclasses
import logging as std_logging
import math
import pickle

import pytest
from absl import flags
from absl import logging as absl_logging

from cli.app import error_line
from cli.search_flags import define_search_flags, search_fields
from configs import common
from core import logs
from core.errors import ArgumentError, RunError, UsageError, exit_status
from core.logs import quiet_library_logs
from core.rules import Bool, Choice, Float, Int, RuleError, allowing
from model import config as model_config
from model.search_settings import SearchSettings
from tests.helpers import one_device_env, run_in_process, run_py, tiny_config
from training.validate import check_config


def test_rules_refuse_nan_infinities_wrong_types_and_out_of_range_values():
  for rule, good, bad in (
    (Int(min=1), [1, 7], [0, -3, 1.5, True, "2"]),
    (Int(min=1, also=(-1,)), [-1, 4], [0, -2]),
    (Float(min=0.0, below=1.0), [0, 0.5], [1.0, -0.1, math.nan, math.inf, "0.1"]),
    (Float(above=0.0), [1e-9, 3], [0.0, -1.0, math.nan]),
    (Choice("pmap", "mesh"), ["mesh"], ["Mesh", ""]),
  ):
    for value in good:
      rule.check(value)
    for value in bad:
      with pytest.raises(RuleError):
        rule.check(value)


def test_every_field_has_a_description_and_a_rule_its_default_passes():
  flat = common._flatten(common.base_config())
  assert set(flat) == set(common.FIELDS)
  for name, field in common.FIELDS.items():
    assert field.help and len(field.help) < 100, name
    field.rule.check(field.default)


def test_the_model_fields_are_model_configs_declarations(monkeypatch):
  """configs/common.py's model.* fields are model/config.py's hyperparameters, in their order, with
  their defaults, meanings and rules (plus the values resolved later); a hyperparameter declared
  there is a config field with nothing else to write."""
  names = [f.name for f in dataclasses.fields(model_config.TransformerConfig)]
  names += ["rnn_cell", "rnn_bidirectional"]
  assert [n for n in common.FIELDS if n.startswith("model.")] == [
    "model.type",
    *(f"model.{n}" for n in names),
  ]
  for config_class in (model_config.TransformerConfig, model_config.RNNConfig):
    for field in dataclasses.fields(config_class):
      shown = common.FIELDS[f"model.{field.name}"]
      assert shown.help == field.metadata[model_config.HELP], field.name
      if field.default is not dataclasses.MISSING:
        assert shown.default == field.default, field.name
  assert common.FIELDS["model.vocab_size"].rule == Int(min=0)  # 0: the vocabulary's size
  common.FIELDS["model.dtype"].rule.check("auto")
  with pytest.raises(ValueError, match=r"model.dtype='auto': must be one of 'float32'"):
    model_config.TransformerConfig(vocab_size=10, dtype="auto")  # resolved before the model

  @dataclasses.dataclass(frozen=True)
  class WithActivation(model_config.TransformerConfig):
    activation: str = model_config.hyperparameter("relu", "FFN activation", Choice("relu", "gelu"))

  monkeypatch.setattr(model_config, "TransformerConfig", WithActivation)
  fields = common._model_fields()
  assert fields["model.activation"] == common.Field(
    "relu", "FFN activation", Choice("relu", "gelu")
  )
  assert list(fields)[-3:] == ["model.activation", "model.rnn_cell", "model.rnn_bidirectional"]


def test_the_recurrent_models_share_the_transformers_declarations():
  """RNNConfig's common fields are TransformerConfig's (default, meaning, rule); its own int8
  refusal is a check of its own."""
  transformer = {f.name: f for f in dataclasses.fields(model_config.TransformerConfig)}
  for field in dataclasses.fields(model_config.RNNConfig):
    if field.name in transformer:
      assert field.default == transformer[field.name].default, field.name
      assert field.metadata == transformer[field.name].metadata, field.name
  with pytest.raises(ValueError, match="model.dtype='int8': int8 products are not for a recurrent"):
    model_config.RNNConfig(vocab_size=10, dtype="int8")
  with pytest.raises(ValueError, match=r"model.vocab_size=0: must be >= 1"):
    model_config.RNNConfig(vocab_size=0)


def test_allowing_adds_the_values_a_config_resolves_later():
  assert allowing(Int(min=1), 0) == Int(min=0)
  assert allowing(Int(min=1), -1) == Int(min=1, also=(-1,))
  assert allowing(Choice("a", "b"), "auto") == Choice("a", "b", "auto")
  with pytest.raises(TypeError, match="Bool takes no extra values"):
    allowing(Bool(), None)


@pytest.mark.parametrize(
  "override, message",
  [
    ({"optim.learning_rate": -1.0}, "optim.learning_rate=-1.0 must be > 0"),
    ({"optim.learning_rate": math.nan}, "optim.learning_rate=nan must be a finite number > 0"),
    ({"num_train_steps": 0}, "num_train_steps=0 must be >= 1"),
    ({"model.dropout_rate": math.inf}, "model.dropout_rate=inf must be a finite number in [0, 1)"),
    ({"optim.clip_norm": -0.5}, "optim.clip_norm=-0.5 must be >= 0"),
    ({"data.tokens_per_batch": 0}, "data.tokens_per_batch=0 must be >= 1"),
    ({"stop_timeout_s": math.nan}, "stop_timeout_s=nan must be a finite number >= 0"),
    ({"mesh.data": 0}, "mesh.data=0 must be >= 1 or -1"),
    ({"parallelism": "tpu"}, "parallelism='tpu' must be one of 'pmap', 'mesh'"),
    ({"model.d_model": 30}, "model.d_model=30: must be divisible by model.num_heads=4"),
    ({"data.synthetic_min_len": 9, "data.synthetic_max_len": 5}, "synthetic_min_len=9 is larger"),
  ],
)
def test_a_bad_config_value_is_an_error_naming_the_field(override, message):
  with pytest.raises(UsageError) as e:
    check_config(tiny_config(num_devices=1, **override), "train")
  assert message in str(e.value)


_TEARDOWN_PROBE = """
import atexit, os, sys
from absl import logging
from cli import app
from core.errors import UsageError
atexit.register(lambda: open(os.environ["MARKER"], "w").write("Python's shutdown ran"))
def main():
  sys.stdout.write("x" * 100_000 + "\\n")  # buffered: written only if flushed
  logging.warning("a log line")
  if os.environ["MODE"] == "fail":
    raise UsageError("bad input")
app.run(main, prog="probe", skip_teardown=True)
"""


def test_skip_teardown_flushes_everything_then_ends_without_pythons_shutdown(tmp_path):
  """decode.py's ending (cli/app.py `skip_teardown`): after a main that returned, stdout and the
  logs are complete and the status 0 while no atexit handler ran; an error ends as usual."""
  marker = tmp_path / "teardown"
  env = lambda mode: {**one_device_env(), "MARKER": str(marker), "MODE": mode}
  done = run_py("-c", _TEARDOWN_PROBE, "--logtostderr", env=env("ok"))
  assert done.returncode == 0, done.stderr
  assert done.stdout == "x" * 100_000 + "\n" and "a log line" in done.stderr
  assert not marker.exists()
  failed = run_py("-c", _TEARDOWN_PROBE, env=env("fail"))
  assert failed.returncode == 2 and "probe: error: bad input" in failed.stderr
  assert marker.read_text() == "Python's shutdown ran"


def test_exit_status_by_kind():
  assert exit_status(UsageError("x")) == exit_status(ValueError("x")) == 2
  assert exit_status(FileNotFoundError(2, "missing")) == 2
  assert exit_status(RunError("x")) == exit_status(OSError(28, "No space left")) == 1
  assert exit_status(KeyError("bug")) is None  # a bug keeps its traceback


def test_show_config_prints_every_field_with_its_value_and_meaning():
  out = run_py("train.py", "--config=configs/tiny.py", "--show_config", "--config.model.d_model=48")
  assert out.returncode == 0, out.stderr[-2000:]
  lines = out.stdout.strip().splitlines()
  assert len(lines) == len(common.FIELDS)
  shown = {line.split(" = ")[0]: line for line in lines}
  assert set(shown) == set(common.FIELDS)
  assert shown["model.d_model"].startswith("model.d_model = 48 ")  # the override, resolved
  assert common.FIELDS["model.d_model"].help in shown["model.d_model"]
  assert shown["num_train_steps"].startswith("num_train_steps = 200 ")  # from configs/tiny.py
  helped = run_in_process("train.py", "--help")
  assert "--[no]show_config" in helped.stdout + helped.stderr


def test_a_config_file_that_cannot_be_loaded_is_one_line_and_creates_nothing(tmp_path):
  workdir = tmp_path / "w"
  broken = tmp_path / "broken.py"
  broken.write_text("def get_config(:\n")
  for config, message in (
    ("configs/no_such.py", "--config=configs/no_such.py: cannot load it: [Errno 2]"),
    (str(broken), f"--config={broken}: cannot load it (line 1): SyntaxError"),
  ):
    out = run_in_process("train.py", f"--config={config}", f"--workdir={workdir}")
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("train.py: error: ") and message in lines[0]
  out = run_in_process(
    "train.py", "--config=configs/tiny.py", f"--workdir={workdir}", "--config.seed=-1"
  )
  assert out.returncode == 2 and "config error: seed=-1 must be >= 0" in out.stderr
  assert not workdir.exists()
  out = run_in_process(
    "train.py", "--config=configs/tiny.py", f"--workdir={workdir}", "--process_id=-1"
  )
  assert out.returncode == 2 and "flag --process_id=-1: must be >= 0" in out.stderr
  assert not workdir.exists()


@pytest.mark.parametrize(
  "overrides, unknown",
  [
    (["--config.num_train_steps=4", "--config.no_group.patience=1"], "config.no_group.patience"),
    (["--config.no_group.patience=1", "--config.num_train_steps=4"], "config.no_group.patience"),
    (["--config.seed=1", "--config.no_field=1", "--config.model.num_layers=1"], "config.no_field"),
    (
      ["--config.model.num_layers=1", "--config.model.nope=2", "--config.seed=1"],
      "config.model.nope",
    ),
  ],
)
def test_an_unknown_config_field_is_named_as_given_wherever_it_stands(tmp_path, overrides, unknown):
  """Valid fields before and after it, nested or top-level, a missing group or a missing field:
  the line names the unknown one as typed."""
  out = run_in_process("train.py", "--config=configs/tiny.py", f"--workdir={tmp_path}", *overrides)
  last = out.stderr.strip().splitlines()[-1]
  assert out.returncode == 2 and f"unknown config field {unknown!r}" in last, last


def test_quiet_library_logs_hides_only_the_expected_library_warnings(caplog, monkeypatch):
  """`quiet_library_logs()` (what the command lines install, and Python users may call): Orbax's
  missing-metadata and unscored-save warnings are dropped from absl's logger below verbosity 2,
  other warnings and --verbosity=2 keep them. The library never calls it (tests/test_restore.py
  loads a Translator)."""
  absl_logger = std_logging.getLogger("absl")
  monkeypatch.setattr(absl_logger, "filters", list(absl_logger.filters))  # undone after the test
  quiet_library_logs()
  quiet_library_logs()  # idempotent: one filter of each kind
  kinds = [type(f) for f in absl_logger.filters]
  assert len(kinds) == len(set(kinds)) and logs._ExpectedWarnings in kinds
  with caplog.at_level(std_logging.WARNING):
    absl_logging.warning("Metadata file does not exist: /w/checkpoints/3/state")
    absl_logging.warning("Requested `tracked_metric`; did not provide metrics.")
    absl_logging.warning("a warning that matters")
    # --verbosity=1 still hides them
    monkeypatch.setattr(absl_logging, "get_verbosity", lambda: 1)
    absl_logging.warning("Metadata file does not exist: hidden")
    # --verbosity=2, without touching absl's logger level (other tests' caplog relies on it)
    monkeypatch.setattr(absl_logging, "get_verbosity", lambda: 2)
    absl_logging.warning("Metadata file does not exist: shown")
  messages = [r.getMessage() for r in caplog.records]
  assert messages == ["a warning that matters", "Metadata file does not exist: shown"]


def test_the_command_lines_drop_library_info_and_expected_warnings_from_any_logger(monkeypatch):
  """The filter `command_line_logs()` puts on absl's handler: a library's INFO lines and expected
  warnings are dropped whichever logger they come through (JAX's own, say), its other warnings
  and this project's lines kept, at --verbosity=1 too; --verbosity=2 keeps everything."""

  def record(level, message, path):
    return std_logging.LogRecord("jax", level, path, 1, message, None, None)

  library = "/venv/lib/python3.11/site-packages/jax/_src/xla_bridge.py"
  ours = logs.PROJECT_ROOT + "/training/loop.py"
  chatter = logs._LibraryChatter()
  kept = [
    (std_logging.INFO, "compiling", library),
    (std_logging.WARNING, "Unable to initialize backend 'tpu'", library),
    (std_logging.WARNING, "a warning that matters", library),
    (std_logging.INFO, "step 10", ours),
  ]
  assert [chatter.filter(record(*r)) for r in kept] == [False, False, True, True]
  monkeypatch.setattr(absl_logging, "get_verbosity", lambda: 1)
  assert [chatter.filter(record(*r)) for r in kept] == [False, False, True, True]
  monkeypatch.setattr(absl_logging, "get_verbosity", lambda: 2)
  assert all(chatter.filter(record(*r)) for r in kept)


def test_library_errors_name_python_arguments_and_command_lines_name_flags():
  """An ArgumentError reads as Python in Python (`checkpoint='x': ...`); a command line prints it
  as the flag that gave the value when it defines one of that name (or of the name `flag_names`
  maps it to), and as the library wrote it otherwise."""
  error = ArgumentError("checkpoint", "average:x", "expected average:<k> with k an integer")
  assert str(error) == "checkpoint='average:x': expected average:<k> with k an integer"
  assert exit_status(error) == 2 and isinstance(error, ValueError)
  defined = flags.FlagValues()
  flags.DEFINE_string("checkpoint", "latest", "", flag_values=defined)
  flags.DEFINE_string("model", None, "", flag_values=defined)
  assert error_line(error, flag_values=defined) == (
    "--checkpoint=average:x: expected average:<k> with k an integer"
  )
  assert error_line(error, flag_values=flags.FlagValues()) == str(error)  # no such flag
  other = ArgumentError("model_dir", "/m", "no model.bin")
  assert error_line(other, {"model_dir": "model"}, defined) == "--model=/m: no model.bin"
  assert error_line(RunError("disk full"), flag_values=defined) == "disk full"
  assert pickle.loads(pickle.dumps(error)).args == error.args  # crosses processes whole


def test_the_stopping_flag_picks_beam_searchs_rule_and_unset_keeps_the_penaltys():
  """--stopping (cli/search_flags.py, decode.py's and the CTranslate2 command's) is exact or
  finished; unset, the settings keep None: each length penalty's own rule. Another value is a
  one-line flag error."""
  defined = flags.FlagValues()
  define_search_flags(defined)
  defined(["prog", "--length_penalty=fairseq"])
  settings = SearchSettings(**search_fields(defined))
  assert settings.stopping is None and settings.stopping_rule == "finished"
  defined(["prog", "--stopping=exact"])
  assert SearchSettings(**search_fields(defined)).stopping_rule == "exact"
  assert "exact" in defined["stopping"].help and "finished" in defined["stopping"].help
  with pytest.raises(flags.IllegalFlagValueError, match="exact|finished") as caught:
    defined(["prog", "--stopping=soon"])
  assert "\n" not in str(caught.value)
