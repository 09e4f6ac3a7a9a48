"""Training: the schedule, the step's invariants, parallel equivalence, train.py end to end."""

import functools
import inspect
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import common
from tests.helpers import (
  fixed_batches,
  make_parallel,
  run_in_process,
  run_py,
  tiny_config,
)
from training import parallel as par
from training.state import learning_rate_schedule


def parallel_for(**overrides):
  """The `Parallel` of `tiny_config(**overrides)`, one for the file: a test that runs its step
  and another that inspects it share one traced and compiled program."""
  return _parallel(tuple(sorted(overrides.items())))


@functools.cache
def _parallel(overrides):
  return make_parallel(tiny_config(**dict(overrides)))


def run_losses(p, batches, start=None):
  """The losses of `p`'s train step over `batches` from `start` (a host state, placed by `p`) or,
  without it, from `p`'s own initial state (key 0); the final state on the host and placed."""
  state = p.init_state(jax.random.key(0)) if start is None else p.place_state(start)
  losses = []
  for b in batches:
    state, m = p.train_step(state, b, jax.random.key(1))
    losses.append(float(m["loss"]))
  return np.array(losses), p.host_state(state), state


def jitted_train_step(p):
  """The jitted train step `p.train_step` calls (training/parallel.py's own, found among its
  closure's variables): lowering it again for the shapes a run gave it reuses that run's trace,
  lowering and compiled program."""
  jitted = [
    v for v in inspect.getclosurevars(p.train_step).nonlocals.values() if hasattr(v, "lower")
  ]
  assert len(jitted) == 1, jitted
  return jitted[0]


# ----------------------------------------------------------------------------- schedule
def test_schedule_equals_paper_formula():
  c = common.base_config()
  sched = learning_rate_schedule(c.optim, 512)
  for step in (1, 4000, 16000):
    expected = 512**-0.5 * min(step**-0.5, step * 4000**-1.5)
    # The optimizer's count is 0-based: update number `step` uses count step - 1.
    np.testing.assert_allclose(float(sched(step - 1)), expected, rtol=1e-6)
  with pytest.raises(ValueError, match="optim.schedule='bogus'"):
    c.optim.schedule = "bogus"
    learning_rate_schedule(c.optim, 512)


# ----------------------------------------------------------------------------- parallelism
def adam_atol(config, steps: int) -> float:
  """Parameter tolerance for comparing equivalent runs: 1e-3 of the distance Adam may move a
  parameter in `steps` updates. Adam moves every element by up to the learning rate per step
  whatever the size of its gradient, so an element whose gradient is ~0 (a dead ReLU unit's row
  of W2) turns rounding differences into visible update differences; the errors these tests
  are after (a missing psum, a wrong scale, a dropped micro-batch) move elements by ~lr."""
  sched = learning_rate_schedule(config.optim, config.model.d_model)
  return 1e-3 * sum(float(sched(i)) for i in range(steps))


@pytest.fixture(scope="module")
def reference_run():
  """(batches, losses, final host state, initial host state, Parallel) of one device's run."""
  batches = fixed_batches()
  p = parallel_for(num_devices=1)
  fresh = p.host_state(p.init_state(jax.random.key(0)))
  losses, state, _ = run_losses(p, batches, fresh)
  return batches, losses, state, fresh, p


@pytest.mark.slow
@pytest.mark.parametrize("kind,mesh", [("pmap", None), ("mesh", (2, 2, 2))])  # (4, 1, 2): below
def test_parallel_schemes_equal_one_device(reference_run, kind, mesh):
  """Each scheme's own initial state (key 0) and 5 steps equal one device's: losses and the
  final parameters; the (2, 2, 2) mesh really shards the big matrices and Adam's moments."""
  batches, ref_losses, ref_state, _, _ = reference_run
  overrides = {"parallelism": kind, "num_devices": 8}
  if mesh:
    overrides.update({"mesh.data": mesh[0], "mesh.fsdp": mesh[1], "mesh.tensor": mesh[2]})
  p = parallel_for(**overrides)
  losses, state, placed = run_losses(p, batches)
  assert p.kind == kind
  assert np.all(np.diff(ref_losses[:3]) < 0) or ref_losses[-1] < ref_losses[0]
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
  atol = adam_atol(tiny_config(), len(batches))
  for a, b in zip(
    jax.tree_util.tree_leaves(state.params), jax.tree_util.tree_leaves(ref_state.params)
  ):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=atol)
  if mesh == (2, 2, 2):  # really sharded: each device holds a piece of the big matrices
    emb = placed.params["embed"]["embedding"]
    shard = emb.addressable_shards[0].data
    assert shard.size * 4 == emb.size, (emb.shape, shard.shape, emb.sharding)
    wi = placed.params["encoder"]["layer_0"]["ffn"]["wi"]["kernel"]
    assert wi.addressable_shards[0].data.size * 4 == wi.size
    mu = placed.opt_state["adam"].mu["encoder"]["layer_0"]["ffn"]["wi"]["kernel"]
    assert mu.addressable_shards[0].data.size * 4 == mu.size  # Adam's moments sharded like wi


# A data- and tensor-sharded mesh with dropout on: run by the dropout test, its compiled step
# inspected by the tensor-parallel one (the same `Parallel`: the program is compiled once).
DROP = {"model.dropout_rate": 0.3, "model.attention_dropout_rate": 0.3}
DATA_TENSOR_MESH = {"mesh.data": 2, "mesh.fsdp": 1, "mesh.tensor": 4, **DROP}


@pytest.mark.slow
def test_dropout_on_a_mesh_equals_dropout_on_one_device(reference_run):
  """With dropout on, a data- and tensor-sharded step draws the same masks as one device
  (model/dropout.py hashes each element's global index, whatever the sharding), so the runs
  match (both from the reference run's initial state: the schemes' own initial states are
  compared above); the first loss differs from the same batch's without dropout, so the masks
  are really applied."""
  batches, no_drop, _, fresh, _ = reference_run
  batches = batches[:3]
  ref, ref_state, _ = run_losses(parallel_for(num_devices=1, **DROP), batches, fresh)
  losses, state, _ = run_losses(
    parallel_for(num_devices=8, parallelism="mesh", **DATA_TENSOR_MESH), batches, fresh
  )
  np.testing.assert_allclose(losses, ref, rtol=1e-4)
  atol = adam_atol(tiny_config(), len(batches))
  for a, b in zip(
    jax.tree_util.tree_leaves(state.params), jax.tree_util.tree_leaves(ref_state.params)
  ):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=atol)
  assert abs(no_drop[0] - ref[0]) > 1e-3, (no_drop[0], ref[0])  # the same batches, no dropout


@pytest.mark.slow
@pytest.mark.parametrize(
  "devices,accum,parallelism", [(1, 4, "mesh"), (8, 2, "mesh"), (2, 2, "pmap")]
)
def test_gradient_accumulation_equals_one_big_step(reference_run, devices, accum, parallelism):
  """k micro-batches accumulated equal the reference's whole-batch steps, from its initial
  state."""
  batches, ref_losses, ref_state, fresh, _ = reference_run
  p = parallel_for(
    num_devices=devices, parallelism=parallelism, **{"optim.grad_accum_steps": accum}
  )
  losses, state, _ = run_losses(p, batches, fresh)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5 if devices == 1 else 1e-4)
  atol = adam_atol(tiny_config(), len(batches))
  for a, b in zip(
    jax.tree_util.tree_leaves(state.params), jax.tree_util.tree_leaves(ref_state.params)
  ):
    np.testing.assert_allclose(a, b, rtol=1e-4 if devices == 1 else 1e-3, atol=atol)


def compiled_mesh_step(**overrides):
  """(train_step, Parallel, compiled HLO text) of the tiny model's step over an 8-device mesh
  with the given config overrides: the jitted step training/parallel.py made for that config
  (`train_step`: the function it jits), lowered for the placed state's shapes and shardings and
  a batch of the runs' shape (a program a run above compiled is taken from its trace and
  compilation, not made again)."""
  p = parallel_for(num_devices=8, parallelism="mesh", **overrides)
  jitted = jitted_train_step(p)
  batch = p.place_batch(fixed_batches(1)[0])
  hlo = jitted.lower(p.restore_target, batch, jax.random.key(1)).compile().as_text()
  return jitted.__wrapped__, p, hlo


def test_accumulation_on_a_data_mesh_gathers_nothing():
  """Each micro-batch must stay spread over every data-parallel device: taking consecutive rows
  made XLA all-gather each micro-batch and compute it on every device (k times the work). The
  step is the one the accumulation test ran on 8 devices."""
  step, p, hlo = compiled_mesh_step(**{"optim.grad_accum_steps": 2})
  assert "all-gather" not in hlo
  assert " while(" in hlo or " while " in hlo  # the micro-batches run in a loop (lax.scan)
  bad = jax.tree_util.tree_map(lambda x: x[:6], fixed_batches(1)[0])
  with pytest.raises(
    ValueError, match=r"batch of 6 rows is not divisible by optim.grad_accum_steps=4"
  ):
    jax.eval_shape(
      functools.partial(step, grad_accum_steps=4), p.abstract_state, bad, jax.random.key(1)
    )


def test_tensor_parallel_step_moves_no_activations_between_devices():
  """With the heads sharded over mesh.tensor, the query/key/value product must stay on each
  device's heads: concatenating the kernels along `heads` made XLA permute shards around every
  attention layer (collective-permute in the compiled step). Dropout on (the step the dropout
  test ran, inspected as it compiled it): its masks move nothing either."""
  _, _, hlo = compiled_mesh_step(**DATA_TENSOR_MESH)
  assert "collective-permute" not in hlo and "all-to-all" not in hlo


@pytest.mark.slow
def test_nonfinite_update_is_skipped_and_counted(reference_run):
  """A step with NaN parameters is skipped and counted: parameters, Adam's moments and count
  unchanged, the streak 1, the step counted; the next good step uses the schedule's first rate.
  On the reference run's one-device `Parallel` and initial state (its step, compiled once)."""
  batches, _, _, fresh, p = reference_run

  def poison(x):  # NaN in the first column of every matrix
    x = np.array(x)
    if x.ndim == 2:
      x[..., 0] = np.nan
    return x

  state = p.place_state(fresh.replace(params=jax.tree_util.tree_map(poison, fresh.params)))
  before = p.host_state(state)
  new, m = p.train_step(state, batches[0], jax.random.key(1))
  after = p.host_state(new)
  assert int(m["nonfinite"]) == 1 and int(after.nonfinite_streak) == 1
  assert int(after.step) == 1
  for a, b in zip(
    jax.tree_util.tree_leaves(before.params), jax.tree_util.tree_leaves(after.params)
  ):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(
    jax.tree_util.tree_leaves(before.opt_state),  # Adam's moments and count too
    jax.tree_util.tree_leaves(after.opt_state),
  ):
    np.testing.assert_array_equal(a, b)
  # The skipped step did not advance the schedule: the next good step uses (and logs) its first
  # rate.
  from training.state import make_optimizer

  schedule = make_optimizer(tiny_config(num_devices=1))[1]
  good = new.replace(params=p.place_state(fresh).params)
  _, m2 = p.train_step(good, batches[0], jax.random.key(2))
  assert int(m2["nonfinite"]) == 0
  np.testing.assert_allclose(float(m2["learning_rate"]), float(schedule(0)), rtol=1e-6)
  assert float(schedule(0)) != float(schedule(1))


def test_float16_training_and_cudnn_float32_are_refused():
  from training.run_steps import build_steps
  from training.validate import check_config

  with pytest.raises(
    ValueError,
    match=r"model.dtype='float16' cannot train here: there is no loss "
    r"scaling",
  ):
    check_config(tiny_config(num_devices=1, **{"model.dtype": "float16"}), "train")
  with pytest.raises(
    ValueError,
    match=r"model.attention_impl='cudnn': cuDNN's fused attention takes "
    r"bfloat16 or float16 only",
  ):
    build_steps(tiny_config(num_devices=1, **{"model.attention_impl": "cudnn"}))


def test_bad_loop_settings_are_config_errors(tmp_path):
  from core.errors import UsageError
  from training.loop import train
  from training.validate import check_config

  for eps in (1.0, -0.1):
    with pytest.raises(ValueError, match=rf"optim.label_smoothing={eps} must be in \[0, 1\)"):
      check_config(tiny_config(num_devices=1, **{"optim.label_smoothing": eps}), "train")
  with pytest.raises(ValueError, match="model.attention_impl='cudnn' needs an even data.max_len"):
    check_config(
      tiny_config(
        num_devices=1,
        **{"model.attention_impl": "cudnn", "model.dtype": "bfloat16", "data.max_len": 33},
      ),
      "train",
    )
  with pytest.raises(UsageError, match=r"eval_every_steps=0 must be >= 1"):
    train(tiny_config(num_devices=1, eval_every_steps=0), tmp_path)


def test_model_vocab_size_is_fitted_to_the_vocabulary(caplog):
  """0 takes the vocabulary's size; fewer ids than the vocabulary is an error; more is a warning
  (those ids never occur but get logits and label-smoothing mass)."""
  from core.errors import UsageError
  from training.loop import fit_model_vocab

  config = tiny_config(num_devices=1, **{"model.vocab_size": 0})
  fit_model_vocab(config, 40)
  assert config.model.vocab_size == 40
  with pytest.raises(
    UsageError, match=r"model.vocab_size=40 is smaller than the vocabulary \(41 ids\)"
  ):
    fit_model_vocab(config, 41)
  with caplog.at_level(logging.WARNING):
    fit_model_vocab(config, 40)
    assert not caplog.records
    fit_model_vocab(config, 32)
  assert "model.vocab_size=40 is larger than the vocabulary (32 ids)" in caplog.text


def test_logged_train_metrics_are_token_weightedwindow_means():
  from training.metric_log import accumulate, window_means

  def step(loss, acc, tokens, grad_norm, nonfinite=0, lr=0.5):
    return {
      "loss": jnp.float32(loss),
      "nll": jnp.float32(loss + 1),
      "accuracy": jnp.float32(acc),
      "tokens": jnp.float32(tokens),
      "grad_norm": jnp.float32(grad_norm),
      "learning_rate": jnp.float32(lr),
      "nonfinite": jnp.int32(nonfinite),
      "nonfinite_streak": jnp.int32(nonfinite),
    }

  steps = [
    step(2.0, 0.5, 100, 1.0),
    step(4.0, 0.25, 300, 3.0),
    step(float("nan"), 0.0, 200, float("inf"), nonfinite=1, lr=0.25),
  ]
  window = None
  for m in steps:
    window = accumulate(window, m)
  got = window_means(jax.device_get(window), jax.device_get(steps[-1]))
  assert got["loss"] == pytest.approx((2 * 100 + 4 * 300) / 400)  # the skipped step left out
  assert got["nll"] == pytest.approx((3 * 100 + 5 * 300) / 400)
  assert got["accuracy"] == pytest.approx((0.5 * 100 + 0.25 * 300) / 400)
  assert got["grad_norm"] == pytest.approx(2.0) and got["tokens"] == pytest.approx(200)
  assert got["nonfinite"] == 1 and got["nonfinite_streak"] == 1 and got["steps"] == 3
  assert got["learning_rate"] == pytest.approx(0.25)
  only_skipped = window_means(jax.device_get(accumulate(None, steps[-1])), steps[-1])
  assert np.isnan(only_skipped["loss"]) and np.isnan(only_skipped["grad_norm"])


def test_bad_parallel_settings_are_clear():
  with pytest.raises(
    ValueError,
    match=r"mesh.data × mesh.fsdp × mesh.tensor = 3 × 1 × 1 = 3, but there are 8 devices",
  ):
    par.make_mesh({"data": 3, "fsdp": 1, "tensor": 1})
  with pytest.raises(ValueError, match="8 devices cannot be split into mesh"):
    par.make_mesh({"data": -1, "fsdp": 3, "tensor": 1})
  p = parallel_for(parallelism="pmap", num_devices=8)  # the pmap scheme test's
  state = p.abstract_state  # the batch is refused before the state is looked at
  bad = fixed_batches(1, rows=12)[0]
  with pytest.raises(ValueError, match="12 rows .* not divisible by the 8"):
    p.train_step(state, bad, jax.random.key(0))


# ----------------------------------------------------------------------------- train.py
def test_train_lowers_loss_and_writes_metrics(tmp_path):
  from training.loop import train

  config = tiny_config(num_devices=1)
  config.eval.bleu_sentences = 16
  train(config, tmp_path)
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  train_losses = [r["loss"] for r in records if r["split"] == "train"]
  assert [r["step"] for r in records if r["split"] == "train"] == [5, 10, 15, 20]
  assert train_losses[-1] < train_losses[0]
  final = [r for r in records if r["split"] == "eval"][-1]
  for key in ("loss", "accuracy", "perplexity", "bleu", "exact_match"):
    assert key in final
  assert final["perplexity"] == pytest.approx(np.exp(final["nll"]), rel=1e-4)
  assert 0 < final["accuracy"] < 1
  assert 0 <= final["bleu"] <= 100 and 0 <= final["exact_match"] <= 1
  assert all(k in records[0] for k in ("learning_rate", "tokens_per_s", "loss"))
  assert list((tmp_path / "tensorboard").iterdir())
  assert (tmp_path / "checkpoints" / "20").is_dir()


def test_too_many_nonfinite_steps_stop_training(tmp_path):
  from core.errors import RunError
  from training.loop import train

  config = tiny_config(
    num_devices=1, **{"optim.learning_rate": 1e30, "optim.max_nonfinite_steps": 3}
  )
  with pytest.raises(RunError, match="consecutive steps had a non-finite loss"):
    train(config, tmp_path)


def test_train_py_bad_input_is_one_clear_line(tmp_path):
  """Checked in this process through train.py's `__main__` (tests/helpers.py run_in_process):
  a workdir that cannot be created, an unknown config field, training files whose sides differ in
  length, an unknown TFDS dataset."""
  blocker = tmp_path / "file"
  blocker.write_text("x")
  out = run_in_process("train.py", "--config=configs/tiny.py", f"--workdir={blocker}/sub")
  assert out.returncode == 2 and "not writable" in out.stderr and "Traceback" not in out.stderr
  out = run_in_process(
    "train.py", "--config=configs/tiny.py", f"--workdir={tmp_path}/w", "--config.optim.lr=3"
  )
  assert out.returncode == 2 and "unknown config field 'config.optim.lr'" in out.stderr
  d = tmp_path / "corpus"
  d.mkdir()
  (d / "train.en").write_text("a\nb\nc\n")
  (d / "train.de").write_text("x\ny\n")
  out = run_in_process(
    "train.py",
    "--config=configs/tiny.py",
    f"--workdir={tmp_path}/w2",
    "--config.data.name=files",
    f"--config.data.dir={d}",
  )
  assert out.returncode == 2, out.stderr[-2000:]
  assert "train.en" in out.stderr and "train.de" in out.stderr and "Traceback" not in out.stderr
  out = run_in_process(
    "train.py",
    "--config=configs/tiny.py",
    f"--workdir={tmp_path}/w3",
    "--config.data.name=no_such_tfds_dataset",
  )
  assert out.returncode == 2 and "no_such_tfds_dataset" in out.stderr


def test_train_py_empty_training_files_are_one_line_naming_them(tmp_path):
  """Both sides empty (SentencePiece's own error would name no file). A real train.py process:
  its whole stderr is the one error line."""
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  for name in ("train.en", "train.de", "validation.en", "validation.de"):
    (corpus / name).write_text("" if name.startswith("train") else "a\n")
  out = run_py(
    "train.py",
    "--config=configs/tiny.py",
    f"--workdir={tmp_path}/w",
    "--config.data.name=files",
    f"--config.data.dir={corpus}",
    timeout=120,
  )
  assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
  error = out.stderr.strip().splitlines()[-1]
  assert error.startswith("train.py: error: ") and out.stderr.count("error") == 1
  assert f"{corpus / 'train.en'} and {corpus / 'train.de'} are empty" in error
  assert not (tmp_path / "w" / "vocab.model").exists()


def test_mesh_axes_that_divide_no_parameter_dimension_are_reported(caplog):
  """tensor=8 with 4 heads: the attention kernels stay replicated (the vocabulary's 36 over 8 is
  expected and not listed); fsdp=8 with d_model 32 divides, so nothing is reported for it."""
  from training.run_steps import build_steps

  with caplog.at_level(logging.WARNING):
    build_steps(tiny_config(num_devices=8, **{"mesh.data": 1, "mesh.tensor": 8}))
  text = caplog.text
  assert "does not divide" in text and "heads=4 over tensor" in text and "vocab=" not in text
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    build_steps(tiny_config(num_devices=8, **{"mesh.data": 1, "mesh.fsdp": 8}))
  assert "does not divide" not in caplog.text and "shards no parameter" not in caplog.text
