"""bench.py, benchmark/ and training/flops.py: the FLOP formulas by hand and against the models'
own matrix products, each mode's JSON, a device sweep and the checks made before any work."""

import concurrent.futures
import gzip
import json
import os
import subprocess
import sys
import threading

import pytest

from benchmark import decoding, paired, peak, records, report, sweeps, timing
from benchmark.options import Options
from cli import bench as cli_bench
from cli import bench_processes
from cli.host_memory import user_settings
from configs import common, tiny
from core.errors import RunError, UsageError
from tests.helpers import REPO, cpu_env, run_in_process
from training import flops

# A one-layer tiny model: these tests check fields and plumbing, not speed.
SMALL = [
  "--config=configs/tiny.py",
  "--config.model.vocab_size=64",
  "--config.model.num_layers=1",
  "--config.bench.batch_size=4",
  "--config.bench.seq_len=8",
  "--steps=2",
  "--warmup=1",
  "--matmul_size=128",
]


def _model_cfg(**fields):
  c = common.base_config().model
  c.update(fields)
  return c


def test_flops_hand_count_one_layer():
  cfg = _model_cfg(vocab_size=10, d_model=8, d_ff=16, num_heads=2, num_layers=1)
  b, s, t, d, f, v = 2, 3, 4, 8, 16, 10
  # Encoder: Q, K, V, O (4·d² weights) on b·s tokens; QKᵀ and AV; the two FFN matrices.
  enc = 2 * (4 * d * d) * (b * s) + 2 * 2 * b * s * s * d + 2 * (2 * d * f) * (b * s)
  assert enc == 3072 + 576 + 3072
  # Decoder: self-attention on b·t tokens; cross Q, O on b·t and K, V on the b·s encoder
  # outputs; cross QKᵀ and AV over t × s; FFN; the d × vocab output projection on b·t.
  dec = (
    2 * (4 * d * d) * (b * t)
    + 2 * 2 * b * t * t * d
    + 2 * (2 * d * d) * (b * t)
    + 2 * (2 * d * d) * (b * s)
    + 2 * 2 * b * t * s * d
    + 2 * (2 * d * f) * (b * t)
  )
  assert dec == 4096 + 1024 + 2048 + 1536 + 768 + 4096
  out = 2 * d * v * (b * t)
  assert out == 1280
  assert flops.forward_flops(cfg, b, s, t) == enc + dec + out == 21568
  assert flops.train_flops(cfg, b, s, t) == 3 * 21568
  parts = flops.forward_breakdown(cfg, b, s, t)
  assert parts["output_projection"] == 1280
  assert parts["encoder_attention"] + parts["decoder_attention"] == 576 + 1024 + 768


def test_flops_scale_with_layers_and_reject_unknown_types():
  one = _model_cfg(vocab_size=10, d_model=8, d_ff=16, num_layers=1)
  two = _model_cfg(vocab_size=10, d_model=8, d_ff=16, num_layers=2)
  out = 2 * 8 * 10 * 2 * 4
  assert flops.forward_flops(two, 2, 3, 4) - out == 2 * (flops.forward_flops(one, 2, 3, 4) - out)
  # Decoder-only: one stack over s + t tokens, the projection on the t target tokens only.
  lm = _model_cfg(type="decoder_only", vocab_size=10, d_model=8, d_ff=16, num_layers=1)
  length = 3 + 4
  assert flops.forward_flops(lm, 2, 3, 4) == (
    2 * 4 * 64 * 2 * length + 2 * 2 * 2 * length**2 * 8 + 2 * 2 * 8 * 16 * 2 * length + out
  )
  with pytest.raises(ValueError, match="model.type='mamba'.*rnn_attention"):
    flops.forward_flops(_model_cfg(type="mamba", vocab_size=10), 2, 3, 4)


def test_flops_hand_count_recurrent_one_layer():
  cfg = _model_cfg(
    type="rnn_attention",
    vocab_size=10,
    d_model=4,
    num_layers=1,
    rnn_cell="gru",
    rnn_bidirectional=True,
  )
  b, s, t, h, v = 2, 3, 4, 4, 10
  c, g = 2 * h, 3 * h  # encoder state [forward; backward]; GRU gates
  # Encoder, both directions: W x (x: the h-wide embedding) and U h over b·s positions.
  enc = 2 * (2 * h * g * b * s) + 2 * (2 * h * g * b * s)
  assert enc == 1152 + 1152
  # Decoder over b·t positions: s_0 = tanh(W c); W y_{t-1} and W_c c_t into the gates; U s;
  # tanh(W_o [s; y; c]) from 2h + c to h; the h × vocab output projection.
  dec = (
    2 * c * h * b * t
    + 2 * h * g * b * t
    + 2 * c * g * b * t
    + 2 * h * g * b * t
    + 2 * (2 * h + c) * h * b * t
    + 2 * h * v * b * t
  )
  assert dec == 512 + 768 + 1536 + 768 + 1024 + 640
  # Bahdanau attention: U h_j once per source state, W s_{t-1} per step, then per step the
  # scores vᵀ tanh(.) (h-wide) and the context Σ α h (c-wide) over the s source states.
  att = 2 * c * h * b * s + 2 * h * h * b * t + 2 * h * b * t * s + 2 * c * b * t * s
  assert att == 384 + 256 + 192 + 384
  assert flops.forward_flops(cfg, b, s, t) == enc + dec + att == 8768
  assert flops.train_flops(cfg, b, s, t) == 3 * 8768
  cfg.type = "rnn"  # the context-vector model: the same without attention
  assert flops.forward_flops(cfg, b, s, t) == enc + dec == 7552
  assert flops.forward_breakdown(cfg, b, s, t)["output_projection"] == 640


def _matmul_flops(jaxpr) -> int:
  """2 × the multiply-adds of every dot_general in a jaxpr, into sub-jaxprs (a scan's body
  counted `length` times)."""
  import math

  import jax.extend.core as jcore

  total = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (_, rhs_contract), (_, rhs_batch) = eqn.params["dimension_numbers"]
      lhs, rhs = (v.aval.shape for v in eqn.invars)
      free = [d for i, d in enumerate(rhs) if i not in rhs_contract and i not in rhs_batch]
      total += 2 * math.prod(lhs) * math.prod(free)
    times = eqn.params["length"] if eqn.primitive.name == "scan" else 1
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if isinstance(sub, jcore.ClosedJaxpr):
          sub = sub.jaxpr
        if isinstance(sub, jcore.Jaxpr):
          total += times * _matmul_flops(sub)
  return total


@pytest.mark.parametrize(
  "fields",
  [
    pytest.param(dict(type="transformer"), id="transformer"),
    pytest.param(dict(type="decoder_only"), id="decoder_only"),
    pytest.param(
      dict(type="decoder_only", share_embeddings=False, num_layers=2), id="decoder_only-unshared-2"
    ),
    pytest.param(dict(type="rnn"), id="rnn-gru-bi"),
    pytest.param(dict(type="rnn_attention"), id="rnn_attention-gru-bi"),
    pytest.param(
      dict(
        type="rnn_attention",
        rnn_cell="lstm",
        rnn_bidirectional=False,
        num_layers=2,
        share_embeddings=False,
      ),
      id="rnn_attention-lstm-uni-2-unshared",
    ),
    pytest.param(dict(type="rnn", rnn_cell="lstm", num_layers=3), id="rnn-lstm-bi-3"),
  ],
)
def test_flops_equal_the_models_matrix_products(fields):
  """The formula counts exactly the products the forward pass traces (no compilation: the
  jaxpr's dot_generals, scan bodies times their length). XLA's cost_analysis is no reference
  here: it counts elementwise work too, and a scan's body once."""
  import jax
  import jax.numpy as jnp

  from model.build import build_model

  cfg = _model_cfg(vocab_size=40, d_model=16, d_ff=32, num_heads=2, num_layers=1)
  cfg.update(fields)
  model = build_model(cfg)
  b, s, t = 2, 5, 7
  inputs, targets = jnp.ones((b, s), jnp.int32), jnp.ones((b, t), jnp.int32)
  variables = jax.eval_shape(lambda: model.init(jax.random.key(0), inputs, targets))
  jaxpr = jax.make_jaxpr(lambda v: model.apply(v, inputs, targets))(variables)
  assert _matmul_flops(jaxpr.jaxpr) == flops.forward_flops(cfg, b, s, t)


# The runs of `runs` made by bench_processes.run_child (bench.py in a child process, its record
# read from the --json file run_child gives it): a decoding benchmark, and a bad flag.
CHILDREN = {
  "decode": ["--mode=decode", "--config.bench.decode_len=5", "--config.bench.beam_size=2"],
  "bad_flag": ["--config.model.no_such_field=1"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Starts the bench.py runs in the background, in two lanes that overlap each other and the
  in-process tests (compiling is mostly single-threaded); returns
  finish(name) -> (CompletedProcess, its output folder).

  All runs see 8 simulated devices, compile unoptimized (they check plumbing, not speed) and
  share one compilation cache: the sweep's first point is the single run's program, and the
  two decoding runs initialize the same parameters. The runs named in CHILDREN go through
  --separate_processes's `run_child` in flax's environment: finish(name) then gives the record
  it returned, or raises the error it raised.
  """
  env = cpu_env(
    8,
    JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("jax_cache")),
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
  )
  lanes = [
    [
      ("train", ["--config.num_devices=1", "--json={dir}/train.json", "--trace={dir}/trace"]),
      (
        "sweep",
        [
          "--sweep=devices",
          "--sweep_values=1,2",
          "--sweep_parallelism=mesh",
          "--json={dir}/sweep.json",
        ],
      ),
    ],
    [
      ("decode", CHILDREN["decode"]),
      ("bad_flag", CHILDREN["bad_flag"]),
      (
        "decode_nocache",
        [
          "--mode=decode",
          "--config.bench.decode_len=3",
          "--config.bench.beam_size=1",
          "--decode_cache=false",
          "--json={dir}/decode.json",
        ],
      ),
    ],
  ]
  child_env = bench_processes.flax_environment(env)
  folders = {name: tmp_path_factory.mktemp(name) for lane in lanes for name, _ in lane}
  procs, stopping = [], threading.Event()

  def run_lane(lane):
    results = {}
    for name, args in lane:
      if stopping.is_set():
        break
      if name in CHILDREN:
        try:
          results[name] = bench_processes.run_child(SMALL + args, child_env)
        except RunError as e:
          results[name] = e
        continue
      proc = subprocess.Popen(
        [
          sys.executable,
          str(REPO / "bench.py"),
          *SMALL,
          *(a.format(dir=folders[name]) for a in args),
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
      )
      procs.append(proc)
      out, err = proc.communicate()
      results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return results

  pool = concurrent.futures.ThreadPoolExecutor(len(lanes))
  futures = {}
  for lane in lanes:
    future = pool.submit(run_lane, lane)
    futures.update((name, future) for name, _ in lane)

  def finish(name):
    result = futures[name].result(timeout=600)[name]
    if isinstance(result, RunError):
      raise result
    return result, folders[name]

  yield finish
  stopping.set()
  for proc in procs:
    if proc.poll() is None:
      proc.kill()
  pool.shutdown(wait=True)


@pytest.mark.slow
def test_searches_run_to_the_end_without_eos(runs):
  del runs  # started first, so the bench.py runs overlap this in-process test
  import jax
  import jax.numpy as jnp
  import numpy as np

  from model import search

  def eos_first(ids, cache):  # EOS is by far the most likely token, then 5, 4, 3...
    logits = jnp.broadcast_to(jnp.array([0.0, 9.0, 1.0, 2.0, 3.0, 4.0]), (ids.shape[0], 6))
    return logits, cache

  greedy = jax.jit(lambda: search.greedy_search(decoding.without_eos(eos_first), {}, 2, 4))
  np.testing.assert_array_equal(greedy(), np.full((2, 4), 5))
  beam = jax.jit(
    lambda: search.beam_search(decoding.without_eos(eos_first), {}, 2, 4, beam_size=2)[0]
  )
  ids = np.asarray(beam())
  assert ids.shape == (2, 2, 4) and np.all(ids > 1)


def test_simulated_devices_flag(monkeypatch):
  import bench

  monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
  bench._simulate_cpu_devices(["bench.py", "--mode=train"])
  assert os.environ["XLA_FLAGS"] == "--xla_backend_optimization_level=0"
  bench._simulate_cpu_devices(["bench.py", "--sweep", "devices"])
  assert os.environ["XLA_FLAGS"] == (
    "--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=8"
  )
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
  bench._simulate_cpu_devices(["bench.py", "--sweep=devices"])  # a count given: kept
  assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"


def test_bad_settings_are_clear_errors(monkeypatch):
  import jax

  monkeypatch.setattr(jax, "local_device_count", lambda: 8)
  c = tiny.get_config()
  c.model.vocab_size = 64
  c.bench.batch_size = 4
  with pytest.raises(
    UsageError,
    match=r"2 of 4 points cannot run \(none was run\): pmap "
    r"num_devices=3, mesh num_devices=3: bench.batch_size=4 is not divisible "
    r"by 3 data-parallel",
  ):
    sweeps.sweep_configs(c, "devices", ["1", "3"])
  with pytest.raises(UsageError, match="expected integers"):
    sweeps.sweep_configs(c, "seq_len", ["8", "x"])
  with pytest.raises(
    UsageError,
    match=r"3 of 3 points cannot run \(none was run\): "
    r"bench.seq_len=16, bench.seq_len=32, bench.seq_len=64: bench.batch_size=4 is "
    r"not divisible by 8 data-parallel",
  ):
    sweeps.sweep_configs(c, "seq_len", None)
  c.bench.batch_size = 8
  assert [p[0] for p in sweeps.sweep_configs(c, "seq_len", None)] == [16, 32, 64]  # max_len 64
  c.bench.seq_len = 100
  with pytest.raises(UsageError, match="bench.seq_len=100 is longer than model.max_len=64"):
    timing.check_config(c, "train")


def test_device_sweep_checks_every_point_with_its_data_parallel_size():
  """mesh.tensor=2: a mesh point needs an even device count, and splits the batch over
  devices / 2 only. Nothing runs when any point cannot."""
  c = tiny.get_config()
  c.model.vocab_size = 64
  c.mesh.tensor = 2
  c.bench.batch_size = 4
  # pmap ignores the mesh, mesh on 1 device cannot hold tensor=2: refused before any point runs.
  with pytest.raises(
    UsageError,
    match=r"1 of 4 points cannot run \(none was run\): mesh "
    r"num_devices=1: config error: 1 devices cannot be split into mesh",
  ):
    sweeps.sweep_configs(c, "devices", ["1", "2"], ("pmap", "mesh"))
  # 8 devices with tensor 2 split batch 4 four ways, not eight.
  points = sweeps.sweep_configs(c, "devices", ["2", "8"], ("mesh",))
  assert [(n, p) for n, p, _ in points] == [(2, "mesh"), (8, "mesh")]
  c.bench.batch_size = 2
  with pytest.raises(
    UsageError,
    match=r"mesh num_devices=8: bench.batch_size=2 is not divisible "
    r"by 4 data-parallel device\(s\)",
  ):
    sweeps.sweep_configs(c, "devices", ["2", "8"], ("mesh",))


def test_failed_sweep_writes_the_points_done(tmp_path):
  c = tiny.get_config()
  points = [(8, "mesh", c), (16, "mesh", c), (32, "mesh", c)]

  def one(config):
    if len(done) == 2:
      raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")
    done.append(config)
    return {"config": "configs/tiny.py", "seq_len": 8 * len(done)}

  done = []
  path = tmp_path / "sweep.json"
  with pytest.raises(RuntimeError, match="out of memory"):
    sweeps.run_points(points, one, "seq_len", "train", str(path))
  data = json.loads(path.read_text())
  assert data["complete"] is False and data["plot"] is None and data["config"] == "configs/tiny.py"
  assert [p["sweep_value"] for p in data["points"]] == [8, 16]
  assert data["error"] == "seq_len=32 (mesh): RuntimeError: RESOURCE_EXHAUSTED: out of memory"
  done.clear()
  assert [
    r["sweep_value"] for r in sweeps.run_points(points[:2], one, "seq_len", "train", None)
  ] == [8, 16]


def test_paired_timing_swaps_the_order_every_round(monkeypatch):
  """--paired: both sides compile and warm up, then alternate A B, B A, ...; the per-round
  ratio is B's median step over A's."""
  import types

  clock, log = [0.0], []
  monkeypatch.setattr(records, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

  def runner(name, first, step):
    calls = []

    def call():
      clock[0] += first if not calls else step
      calls.append(1)
      log.append(name)

    return records.Runner(name, call, None)

  a, b = runner("A", 5.0, 1.0), runner("B", 7.0, 2.0)
  firsts, times, ratios = paired.time_paired([a, b], steps=2, warmup=1, rounds=3)
  assert firsts == [5.0, 7.0]
  assert log == ["A", "A", "B", "B"] + ["A", "A", "B", "B"] + ["B", "B", "A", "A"] + [
    "A",
    "A",
    "B",
    "B",
  ]
  assert times[0].tolist() == [1.0] * 6 and times[1].tolist() == [2.0] * 6
  assert ratios == [[2.0, 2.0, 2.0]]

  log.clear()  # three sides (ours and two peers): A B C, then C B A; a ratio per peer
  c = runner("C", 3.0, 4.0)
  a, b = runner("A", 5.0, 1.0), runner("B", 7.0, 2.0)
  firsts, times, ratios = paired.time_paired([a, b, c], steps=1, warmup=0, rounds=2)
  assert firsts == [5.0, 7.0, 3.0] and log == list("ABC") + list("ABC") + list("CBA")
  assert ratios == [[2.0, 2.0], [4.0, 4.0]]


@pytest.mark.slow
def test_paired_result_holds_both_records_and_their_ratio():
  """bench_paired on a real runner (ours on both sides here, the same runner: flax's example is
  not installed in the tests, and a second runner would only compile the same step again): both
  train records, the ratio of their median steps, no per-run memory peak."""
  c = tiny.get_config()
  c.model.update(vocab_size=64, num_layers=1)
  c.bench.update(batch_size=4, seq_len=8)
  c.num_devices = 1
  options = Options(mode="train", steps=2, warmup=1, peak="1e15")

  def make(config, options):
    runner = timing.train_runner(config, options)
    return [runner, runner]

  result = paired.bench_paired(c, options, rounds=3, make=make)
  assert set(result) == set(paired.PAIRED_FIELDS)
  assert (result["mode"], result["paired"], result["rounds"], result["steps_per_round"]) == (
    "train",
    True,
    3,
    2,
  )
  ours, theirs = result["records"]
  for record in (ours, theirs):
    assert set(records.TRAIN_FIELDS) <= set(record)
    assert record["peak_memory_bytes"] is None and record["peak_source"] == "given"
    assert record["config"] is None  # no --config command line in this process
  assert result["speedup"] == pytest.approx(theirs["step_time_s"] / ours["step_time_s"])
  assert len(result["speedup_per_round"]) == 3
  assert result["speedup_min"] == min(result["speedup_per_round"])
  assert result["speedup_max"] == max(result["speedup_per_round"])
  json.dumps(result)  # --json writes it as it is


def test_child_argv_drops_the_parents_flags():
  """--separate_processes: each child gets the command line without --paired, --rounds, --json
  and --flax_wmt, in any of absl's spellings; everything else is passed on as it was."""
  argv = [
    "--config=configs/bench_tiny.py",
    "--config.bench.seq_len=32",
    "--paired",
    "--separate_processes",
    "--rounds=4",
    "--json",
    "out.json",
    "--flax_wmt",
    "/f/wmt",
    "--steps=5",
    "--nopaired",
    "--rounds",
    "2",
    "--json=x.json",
    "--flax_wmt=/g",
    "--noseparate_processes",
    "--mode",
    "decode",
    "--decode_cache=false",
  ]
  assert bench_processes.child_argv(argv, cli_bench.parent_only_booleans()) == [
    "--config=configs/bench_tiny.py",
    "--config.bench.seq_len=32",
    "--steps=5",
    "--mode",
    "decode",
    "--decode_cache=false",
  ]


def test_paired_processes_alternate_and_give_flax_glibc_defaults(monkeypatch):
  """bench_paired_processes with a fake child: ours first in even rounds, flax's first in odd
  ones; flax's child gets --flax_wmt and glibc's default malloc (MALLOC_ARENA_MAX = 8 per core,
  which makes cli/host_memory.py stand aside), ours the environment as it is; the speed-up
  is the ratio of the per-round medians, the records those of each side's median round."""
  for name in user_settings():
    monkeypatch.delenv(name)
  steps = {False: iter([1.0, 1.2, 0.9, 1.1]), True: iter([1.5, 1.2, 1.8, 1.4])}
  calls = []

  def run(argv, env):
    flax = any(a.startswith("--flax_wmt=") for a in argv)
    calls.append((flax, argv, env))
    return {
      "implementation": "flax" if flax else "ours",
      "step_time_s": next(steps[flax]),
      "host_memory": "process default" if user_settings(env) else "kept",
      "device_kind": "cpu",
      "dtype": "float32",
    }

  argv = [
    "--config=configs/bench_tiny.py",
    "--steps=3",
    "--paired",
    "--separate_processes",
    "--flax_wmt=/f/wmt",
    "--rounds=4",
    "--json=out.json",
  ]
  result = bench_processes.bench_paired_processes(
    argv, cli_bench.parent_only_booleans(), "/f/wmt", "train", 3, 4, run=run
  )
  assert [flax for flax, _, _ in calls] == [False, True, True, False, False, True, True, False]
  ours_argv = ["--config=configs/bench_tiny.py", "--steps=3"]
  for flax, child, env in calls:
    assert child == (ours_argv + ["--flax_wmt=/f/wmt"] if flax else ours_argv)
    assert (
      (env.get("MALLOC_ARENA_MAX") == str(8 * os.cpu_count())) if flax else (not user_settings(env))
    )
  assert set(result) == set(paired.PAIRED_FIELDS) | {"round_records"}
  assert result["separate_processes"] is True and result["steps_per_round"] == 3
  assert result["speedup_per_round"] == pytest.approx([1.5, 1.0, 2.0, 1.4 / 1.1])
  assert result["speedup"] == pytest.approx(1.45 / 1.05)  # medians of the rounds
  assert (result["speedup_min"], result["speedup_max"]) == pytest.approx((1.0, 2.0))
  ours, theirs = result["records"]  # each side's lower-middle round
  assert (ours["step_time_s"], theirs["step_time_s"]) == (1.0, 1.4)
  assert [r["host_memory"] for r in result["records"]] == ["kept", "process default"]
  assert [len(r) for r in result["round_records"]] == [4, 4]
  report.print_paired(result)  # prints, with the host-memory column

  monkeypatch.setenv("MALLOC_ARENA_MAX", "2")  # the user's own setting: both sides keep it
  assert bench_processes.flax_environment()["MALLOC_ARENA_MAX"] == "2"


@pytest.mark.slow
def test_a_separate_process_reports_its_record_or_its_error(runs):
  """run_child runs bench.py for real (the decoding run of `runs`): flax's environment (without
  flax's example, not installed in the tests) gives a record with glibc's default host memory;
  a bad flag is one RunError that quotes the child's error."""
  record, _ = runs("decode")
  assert record["host_memory"] == "process default"
  assert record["config"] == "configs/tiny.py" and record["implementation"] == "this repository"
  assert record["step_time_s"] > 0
  with pytest.raises(RunError, match="(?s)exit status.*config.model.no_such_field"):
    runs("bad_flag")


def test_paired_needs_flax_and_one_plain_benchmark():

  with pytest.raises(UsageError, match="give --flax_wmt=<its directory>.* or --ctranslate2"):
    cli_bench.check_flags({"paired": True})
  flax = "flax-0.12.8/examples/wmt"
  with pytest.raises(UsageError, match="drop --sweep / --trace"):
    cli_bench.check_flags({"paired": True, "flax_wmt": flax, "sweep": "batch"})
  with pytest.raises(UsageError, match="add --paired and --flax_wmt"):
    cli_bench.check_flags({"separate_processes": True, "flax_wmt": flax, "sweep": "batch"})


def test_ctranslate2_times_one_decoding_benchmark():
  """--ctranslate2 is a decoding peer of one plain benchmark in this process, with the cache, at
  compute types CTranslate2 knows; anything else is a usage error before any work."""

  ok = {"ctranslate2": True, "mode": "decode", "ctranslate2_compute_types": ["float32", "int8"]}
  cli_bench.check_flags(ok)
  cli_bench.check_flags(dict(ok, paired=True))
  for extra, message in [
    ({"mode": "train"}, "--ctranslate2 times decoding: add --mode=decode"),
    ({"flax_wmt": "wmt"}, "--flax_wmt and --ctranslate2 are two peers"),
    ({"sweep": "batch"}, "drop --sweep / --trace / --separate_processes"),
    ({"trace": "t"}, "drop --sweep / --trace / --separate_processes"),
    ({"paired": True, "separate_processes": True}, "drop --sweep / --trace"),
    ({"decode_cache": False}, "decodes with its cache: drop --decode_cache=false"),
    ({"ctranslate2_compute_types": ["int4"]}, "=int4: expected some of default, auto, float32"),
    ({"ctranslate2_compute_types": []}, "--ctranslate2_compute_types=: expected"),
  ]:
    with pytest.raises(UsageError, match=message):
      cli_bench.check_flags(dict(ok, **extra))


def test_ctranslate2_missing_is_a_usage_error_saying_how_to_install_it(monkeypatch):
  """CTranslate2 is optional: bench.py and the export import without it, and using it says how
  to install it (one line, before any work)."""
  from benchmark import ctranslate2

  monkeypatch.setitem(sys.modules, "ctranslate2", None)  # import ctranslate2 -> ImportError
  with pytest.raises(UsageError, match=r"pip install 'attention-jax\[ctranslate2\]'"):
    ctranslate2.check_model(tiny.get_config().model)


def test_json_and_plot_paths_are_checked_before_any_benchmark(tmp_path):
  """--json and --plot: a folder that does not exist or is a file, or a path that is a folder, is
  a one-line usage error (exit 2) before anything runs (cli/files.py's check, as decode.py's)."""
  a_file = tmp_path / "a_file"
  a_file.write_text("")
  for flag, message in (
    (f"--json={a_file}/r.json", f"--json={a_file}/r.json: the folder {a_file} does not exist"),
    (f"--json={tmp_path}/new/r.json", "the folder"),
    (f"--plot={tmp_path}", f"--plot={tmp_path}: is a folder, not a file"),
  ):
    proc = run_in_process("bench.py", *SMALL, flag)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-800:]
    assert last.startswith("bench.py: error: ") and message in last, last
    assert "step_time_s" not in proc.stdout  # nothing was timed


def test_cudnn_needs_an_even_train_length_and_a_gpu():
  c = tiny.get_config()
  c.model.update(vocab_size=64, attention_impl="cudnn", dtype="bfloat16")
  c.bench.seq_len = 7
  with pytest.raises(
    UsageError,
    match=r"model.attention_impl='cudnn' needs an even "
    r"bench.seq_len when training \(cuDNN's masked attention takes even lengths\), got 7",
  ):
    timing.check_config(c, "train")
  for mode in ("decode", "train"):  # decoding takes odd lengths; this host has no GPU either way
    c.bench.seq_len = 7 if mode == "decode" else 8
    with pytest.raises(
      UsageError,
      match=r"model.attention_impl='cudnn' needs an NVIDIA GPU, "
      r"but JAX's backend here is 'cpu'",
    ):
      timing.check_config(c, mode)
  c.model.type = "rnn"  # the recurrent models have no attention_impl
  timing.check_config(c, "decode")


def test_cudnn_on_a_cpu_is_a_one_line_error():
  proc = run_in_process(
    "bench.py",
    *SMALL,
    "--config.num_devices=1",
    "--config.model.attention_impl=cudnn",
    "--config.model.dtype=bfloat16",
  )
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr
  assert (
    "bench.py: error: config error: model.attention_impl='cudnn' needs an NVIDIA GPU, but "
    "JAX's backend here is 'cpu'; use model.attention_impl=xla\n"
  ) in proc.stderr


def test_utilization_reads_the_run_s_memory_before_measuring_the_peak(monkeypatch):
  """The measured peak's matmul raises the device's peak memory: the run's own peak is read
  before it. mfu = achieved / (per-device peak × devices)."""
  import jax

  class Device:
    device_kind = "cpu"
    peak = 500

    def memory_stats(self):
      return {"peak_bytes_in_use": Device.peak}

  def measuring_peak(device, dtype, *choice):
    Device.peak = 10**9  # the matmul's buffers
    return 2e9, "measured"

  monkeypatch.setattr(jax, "local_devices", lambda: [Device(), Device()])
  monkeypatch.setattr(peak, "resolve_peak", measuring_peak)
  monkeypatch.setattr(peak, "peak_samples", lambda device, dtype, size: [1.5e9, 2e9])
  c = tiny.get_config()
  c.model.update(vocab_size=64, type="rnn_attention", num_layers=1)
  c.bench.update(batch_size=4, seq_len=8)
  fields = peak.utilization(c, jax.local_devices(), 0.5, memory_before=100)
  assert fields["peak_memory_bytes"] == 500
  model_flops = flops.train_flops(c.model, 4, 8, 8)
  assert fields["model_flops_per_step"] == model_flops > 0  # recurrent models get a count too
  assert fields["achieved_flops_per_s"] == model_flops / 0.5
  assert (fields["peak_flops_per_s"], fields["peak_flops_per_s_total"]) == (2e9, 4e9)
  assert fields["peak_samples_flops_per_s"] == [1.5e9, 2e9]
  assert fields["mfu"] == pytest.approx(model_flops / 0.5 / 4e9)


def test_datasheet_peaks_follow_the_matmul_precision():
  import jax

  assert peak.datasheet_peak("NVIDIA H200", "bfloat16") == 989.4e12
  assert peak.datasheet_peak("NVIDIA H200", "float32") == 494.7e12  # TF32 tensor cores
  assert peak.datasheet_peak("NVIDIA A100-SXM4-80GB", "float32") == 156e12
  with jax.default_matmul_precision("highest"):
    assert peak.datasheet_peak("NVIDIA H200", "float32") == 66.9e12
  assert peak.datasheet_peak("NVIDIA H100 PCIe", "float32") is None  # measured instead
  assert peak.datasheet_peak("cpu", "float32") is None
  for bad in ("0", "-5e12", "nan", "fast"):
    with pytest.raises(UsageError, match=r"peak=.*expected auto, measured or a positive number"):
      peak.resolve_peak(None, "float32", bad)
  assert peak.resolve_peak(None, "float32", "2e12") == (2e12, "given")


def test_the_measured_peak_is_the_best_of_two_samples_per_device_kind_and_dtype(
  monkeypatch, caplog
):
  """run_benchmark samples the peak before its timed steps and utilization after them; a sample
  caught at half speed (a busy machine) is outvoted and warned about; a sweep's later points
  reuse the same yardstick without running the matmul again."""
  import types

  calls = []
  rates = iter([1e11, 2e11, 3e11, 3.1e11])

  def fake_measure(device, dtype, size):
    calls.append((device.device_kind, dtype, size))
    return next(rates)

  monkeypatch.setattr(peak, "measured_peak", fake_measure)
  monkeypatch.setattr(peak, "_MEASURED_PEAKS", {})
  cpu = types.SimpleNamespace(device_kind="cpu")

  def measured(dtype):  # --peak=measured --matmul_size=512
    return peak.resolve_peak(cpu, dtype, "measured", 512)

  assert measured("float32") == (1e11, "measured")  # before the steps
  with caplog.at_level("WARNING"):
    assert measured("float32") == (2e11, "measured")  # after: the best
  assert "measured matmul rate changed during the run (100 / 200 GFLOP/s)" in caplog.text
  assert measured("float32") == (2e11, "measured")  # later sweep points
  assert peak.peak_samples(cpu, "float32", 512) == [1e11, 2e11]
  caplog.clear()
  with caplog.at_level("WARNING"):
    assert measured("bfloat16") == (3e11, "measured")
    assert measured("bfloat16") == (3.1e11, "measured")
  assert "changed during the run" not in caplog.text  # within 20%: no warning
  assert calls == [("cpu", "float32", 512)] * 2 + [("cpu", "bfloat16", 512)] * 2
  assert peak.peak_samples(cpu, "float16", 512) is None


def test_peak_memory_is_only_reported_when_this_run_set_it(monkeypatch):
  import jax

  class Device:
    def __init__(self, peak):
      self.peak = peak

    def memory_stats(self):
      return {"peak_bytes_in_use": self.peak}

  monkeypatch.setattr(jax, "local_devices", lambda: [Device(100), Device(300)])
  assert peak.peak_memory(jax.local_devices()) == 300
  assert peak.own_peak_memory(None) == 300
  assert peak.own_peak_memory(200) == 300  # this run raised the process's peak: its own
  assert peak.own_peak_memory(300) is None  # an earlier run (sweep point) peaked as high


def _ok(result):
  assert result.returncode == 0, result.stderr[-3000:]
  return result


def test_plot_of_a_decode_sweep(tmp_path):
  records = [
    {
      "mode": "decode",
      "seq_len": n,
      "step_time_s": 0.01 * n,
      "step_time_p10_s": 0.009 * n,
      "step_time_p90_s": 0.012 * n,
      "sent_per_s": 100.0 / n,
    }
    for n in (8, 16, 32)
  ]
  sweeps.plot_sweep(records, "seq_len", tmp_path / "seq.png", "title")
  assert (tmp_path / "seq.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_from_saved_sweeps(tmp_path, capsys):
  def sweep(config, model_type, scale):
    points = [
      {
        "mode": "train",
        "seq_len": n,
        "model_type": model_type,
        "device_kind": "cpu",
        "dtype": "float32",
        "batch_size": 4,
        "step_time_s": scale * n,
        "step_time_p10_s": scale * n,
        "step_time_p90_s": scale * n,
        "tokens_per_s": 1 / scale,
      }
      for n in (8, 16)
    ]
    return {"sweep": "seq_len", "mode": "train", "config": config, "points": points}

  a, b = tmp_path / "a.json", tmp_path / "b.json"
  a.write_text(json.dumps(sweep("configs/x_rnn.py", "rnn_attention", 0.2)))
  b.write_text(json.dumps(sweep("configs/x_tf.py", "transformer", 0.1)))
  sweeps.plot_saved_sweeps([str(a), str(b)], str(tmp_path / "both.png"))
  assert (tmp_path / "both.png").read_bytes()[:4] == b"\x89PNG"
  assert "plot:" in capsys.readouterr().out
  (tmp_path / "c.json").write_text(json.dumps({"mode": "train"}))
  with pytest.raises(UsageError, match="c.json': not a sweep JSON"):
    sweeps.plot_saved_sweeps([str(a), str(tmp_path / "c.json")], str(tmp_path / "x.png"))
  other = dict(sweep("configs/y.py", "transformer", 0.1), sweep="batch")
  (tmp_path / "d.json").write_text(json.dumps(other))
  with pytest.raises(UsageError, match="sweep different things"):
    sweeps.plot_saved_sweeps([str(a), str(tmp_path / "d.json")], str(tmp_path / "x.png"))


@pytest.mark.slow
def test_train_json_has_every_field(runs):
  proc, folder = runs("train")
  _ok(proc)
  record = json.loads((folder / "train.json").read_text())
  assert set(records.TRAIN_FIELDS) <= set(record)
  assert record["mode"] == "train" and record["config"] == "configs/tiny.py"
  assert record["batch_size"] == 4 and record["seq_len"] == 8 and record["num_devices"] == 1
  assert record["parallelism"] == "mesh" and record["dtype"] == "float32"
  assert record["peak_source"] == "measured" and record["peak_flops_per_s"] > 0
  samples = record["peak_samples_flops_per_s"]  # before and after the timed steps
  assert len(samples) == 2 and record["peak_flops_per_s"] == max(samples)
  assert 0 < record["step_time_p10_s"] <= record["step_time_s"] <= record["step_time_p90_s"]
  assert record["tokens_per_s"] == pytest.approx(2 * 4 * 8 / record["step_time_s"])
  cfg = _model_cfg(vocab_size=64, d_model=64, d_ff=128, num_heads=4, num_layers=1)
  assert record["model_flops_per_step"] == flops.train_flops(cfg, 4, 8, 8)
  assert record["mfu"] == pytest.approx(
    record["model_flops_per_step"] / record["step_time_s"] / record["peak_flops_per_s"]
  )
  assert record["peak_flops_per_s_total"] == record["peak_flops_per_s"]  # one device
  assert record["peak_memory_bytes"] is None or record["peak_memory_bytes"] > 0
  # bench.py keeps freed memory by default (on the CPU, without the user's own malloc settings)
  assert record["host_memory"] == ("process default" if user_settings() else "kept")
  assert "tokens_per_s" in proc.stdout and "mfu" in proc.stdout
  assert "(one device)" in proc.stdout and "(all devices)" in proc.stdout
  # --trace: one perfetto trace of the step, without Python frames (those would fill the
  # trace's event buffer while the first call compiles, before the timed steps' XLA ops).
  (trace,) = (folder / "trace").glob(
    "01_train_mesh_1dev_b4_l8/plugins/profile/*/perfetto_trace.json.gz"
  )
  names = {
    e.get("name", "") for e in json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
  }
  assert "PjitFunction(train_step)" in names
  assert not [n for n in names if n.startswith("$")], "Python frames in the trace"


@pytest.mark.slow
def test_decode_json(runs):
  """The decoding run's record, as bench.py wrote it to --json (read back by run_child)."""
  record, _ = runs("decode")
  assert set(records.DECODE_FIELDS) <= set(record)
  assert record["mode"] == "decode" and record["decode_cache"] is True
  assert record["decode_len"] == 5 and record["beam_size"] == 2 and record["num_devices"] == 1
  assert record["sent_per_s"] == pytest.approx(4 / record["step_time_s"])
  assert record["out_tokens_per_s"] == pytest.approx(5 * record["sent_per_s"])


@pytest.mark.slow
def test_uncached_greedy_decode(runs):
  proc, folder = runs("decode_nocache")
  _ok(proc)
  record = json.loads((folder / "decode.json").read_text())
  assert record["decode_cache"] is False and record["beam_size"] == 1
  assert record["out_tokens_per_s"] == pytest.approx(3 * record["sent_per_s"])


@pytest.mark.slow
def test_sweep_devices_writes_plot(runs):
  proc, folder = runs("sweep")
  _ok(proc)
  data = json.loads((folder / "sweep.json").read_text())
  assert data["sweep"] == "devices"
  assert [(p["parallelism"], p["num_devices"]) for p in data["points"]] == [
    ("mesh", 1),
    ("mesh", 2),
  ]
  assert all(p["batch_size"] == 4 and p["tokens_per_s"] > 0 for p in data["points"])
  assert data["complete"] is True
  for p in data["points"]:  # achieved FLOP/s is the devices' total; so is the peak it meets
    assert p["peak_flops_per_s_total"] == pytest.approx(p["peak_flops_per_s"] * p["num_devices"])
    assert p["mfu"] == pytest.approx(
      p["achieved_flops_per_s"] / p["peak_flops_per_s_total"], rel=1e-12
    )
  png = folder / "sweep.png"
  assert data["plot"] == str(png) and png.read_bytes()[:4] == b"\x89PNG"
  assert "sweep: devices" in proc.stdout
