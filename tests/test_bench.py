"""bench.py and training/flops.py: the FLOP formula by hand, each mode's JSON, a device sweep."""
import concurrent.futures
import json
import os
import pathlib
import subprocess
import sys
import threading

import pytest

from configs import common, tiny
from training import flops

REPO = pathlib.Path(__file__).resolve().parents[1]
# A one-layer tiny model: these tests check fields and plumbing, not speed.
SMALL = ["--config=configs/tiny.py", "--config.model.vocab_size=64",
         "--config.model.num_layers=1", "--config.bench.batch_size=4",
         "--config.bench.seq_len=8", "--steps=2", "--warmup=1", "--matmul_size=128"]


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
  dec = (2 * (4 * d * d) * (b * t) + 2 * 2 * b * t * t * d
         + 2 * (2 * d * d) * (b * t) + 2 * (2 * d * d) * (b * s) + 2 * 2 * b * t * s * d
         + 2 * (2 * d * f) * (b * t))
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
  assert flops.forward_flops(lm, 2, 3, 4) == (2 * 4 * 64 * 2 * length + 2 * 2 * 2 * length ** 2 * 8
                                              + 2 * 2 * 8 * 16 * 2 * length + out)
  with pytest.raises(ValueError, match="rnn"):
    flops.forward_flops(_model_cfg(type="rnn", vocab_size=10), 2, 3, 4)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Starts the bench.py runs in the background, in two lanes that overlap each other and the
  in-process tests (compiling is mostly single-threaded); returns
  finish(name) -> (CompletedProcess, its output folder).

  All runs see 8 simulated devices, compile unoptimized (they check plumbing, not speed) and
  share one compilation cache: the sweep's first point is the single run's program, and the
  two decoding runs initialize the same parameters.
  """
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8 "
                       "--xla_backend_optimization_level=0",
             JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("jax_cache")),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  lanes = [
      [("train", ["--config.num_devices=1", "--json={dir}/train.json"]),
       ("sweep", ["--sweep=devices", "--sweep_values=1,2", "--sweep_parallelism=mesh",
                  "--json={dir}/sweep.json"])],
      [("decode", ["--mode=decode", "--config.bench.decode_len=5", "--config.bench.beam_size=2",
                   "--json={dir}/decode.json"]),
       ("decode_nocache", ["--mode=decode", "--config.bench.decode_len=3",
                           "--config.bench.beam_size=1", "--decode_cache=false",
                           "--json={dir}/decode.json"])],
  ]
  folders = {name: tmp_path_factory.mktemp(name) for lane in lanes for name, _ in lane}
  procs, stopping = [], threading.Event()

  def run_lane(lane):
    results = {}
    for name, args in lane:
      if stopping.is_set():
        break
      proc = subprocess.Popen(
          [sys.executable, str(REPO / "bench.py"), *SMALL,
           *(a.format(dir=folders[name]) for a in args)],
          cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
    return futures[name].result(timeout=600)[name], folders[name]

  yield finish
  stopping.set()
  for proc in procs:
    if proc.poll() is None:
      proc.kill()
  pool.shutdown(wait=True)


def test_searches_run_to_the_end_without_eos(runs):
  del runs  # started first, so the bench.py runs overlap this in-process test
  import jax
  import jax.numpy as jnp
  import numpy as np
  import bench
  from model import search

  def eos_first(ids, cache):  # EOS is by far the most likely token, then 5, 4, 3...
    logits = jnp.broadcast_to(jnp.array([0.0, 9.0, 1.0, 2.0, 3.0, 4.0]), (ids.shape[0], 6))
    return logits, cache

  greedy = jax.jit(lambda: search.greedy_search(bench.without_eos(eos_first), {}, 2, 4))
  np.testing.assert_array_equal(greedy(), np.full((2, 4), 5))
  beam = jax.jit(lambda: search.beam_search(bench.without_eos(eos_first), {}, 2, 4,
                                            beam_size=2)[0])
  ids = np.asarray(beam())
  assert ids.shape == (2, 2, 4) and np.all(ids > 1)


def test_simulated_devices_flag(monkeypatch):
  import bench
  monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
  bench._simulate_cpu_devices(["bench.py", "--mode=train"])
  assert os.environ["XLA_FLAGS"] == "--xla_backend_optimization_level=0"
  bench._simulate_cpu_devices(["bench.py", "--sweep", "devices"])
  assert os.environ["XLA_FLAGS"] == ("--xla_backend_optimization_level=0 "
                                     "--xla_force_host_platform_device_count=8")
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
  bench._simulate_cpu_devices(["bench.py", "--sweep=devices"])  # a count given: kept
  assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"


def test_bad_settings_are_clear_errors(monkeypatch):
  import jax
  import bench
  monkeypatch.setattr(jax, "local_device_count", lambda: 8)
  c = tiny.get_config()
  c.model.vocab_size = 64
  c.bench.batch_size = 4
  with pytest.raises(bench.Stop, match=r"bench.batch_size=4 is not divisible by \[3\] devices"):
    bench.sweep_configs(c, "devices", ["1", "3"])
  with pytest.raises(bench.Stop, match="expected integers"):
    bench.sweep_configs(c, "seq_len", ["8", "x"])
  assert [p[0] for p in bench.sweep_configs(c, "seq_len", None)] == [16, 32, 64]  # max_len 64
  c.bench.seq_len = 100
  with pytest.raises(bench.Stop, match="bench.seq_len=100 is longer than model.max_len=64"):
    bench._check_lengths(c)


def test_datasheet_peaks_follow_the_matmul_precision(monkeypatch):
  import types
  import jax
  import bench
  assert bench.datasheet_peak("NVIDIA H200", "bfloat16") == 989.4e12
  assert bench.datasheet_peak("NVIDIA H200", "float32") == 494.7e12  # TF32 tensor cores
  assert bench.datasheet_peak("NVIDIA A100-SXM4-80GB", "float32") == 156e12
  with jax.default_matmul_precision("highest"):
    assert bench.datasheet_peak("NVIDIA H200", "float32") == 66.9e12
  assert bench.datasheet_peak("NVIDIA H100 PCIe", "float32") is None  # measured instead
  assert bench.datasheet_peak("cpu", "float32") is None
  for bad in ("0", "-5e12", "nan", "fast"):
    monkeypatch.setattr(bench, "_PEAK", types.SimpleNamespace(value=bad))
    with pytest.raises(bench.Stop, match=r"--peak=.*expected auto, measured or a positive number"):
      bench.resolve_peak(None, "float32")
  monkeypatch.setattr(bench, "_PEAK", types.SimpleNamespace(value="2e12"))
  assert bench.resolve_peak(None, "float32") == (2e12, "given")


def test_peak_memory_is_only_reported_when_this_run_set_it(monkeypatch):
  import jax
  import bench

  class Device:
    def __init__(self, peak):
      self.peak = peak

    def memory_stats(self):
      return {"peak_bytes_in_use": self.peak}
  monkeypatch.setattr(jax, "local_devices", lambda: [Device(100), Device(300)])
  assert bench.peak_memory(jax.local_devices()) == 300
  assert bench.own_peak_memory(None) == 300
  assert bench.own_peak_memory(200) == 300  # this run raised the process's peak: its own
  assert bench.own_peak_memory(300) is None  # an earlier run (sweep point) peaked as high


def _ok(result):
  assert result.returncode == 0, result.stderr[-3000:]
  return result


def test_plot_of_a_decode_sweep(tmp_path):
  import bench
  records = [{"mode": "decode", "seq_len": n, "step_time_s": 0.01 * n, "step_time_p10_s": 0.009 * n,
              "step_time_p90_s": 0.012 * n, "sent_per_s": 100.0 / n} for n in (8, 16, 32)]
  bench.plot_sweep(records, "seq_len", tmp_path / "p" / "seq.png", "title")
  assert (tmp_path / "p" / "seq.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_from_saved_sweeps(tmp_path, capsys):
  import bench

  def sweep(config, model_type, scale):
    points = [{"mode": "train", "seq_len": n, "model_type": model_type, "device_kind": "cpu",
               "dtype": "float32", "batch_size": 4, "step_time_s": scale * n,
               "step_time_p10_s": scale * n, "step_time_p90_s": scale * n,
               "tokens_per_s": 1 / scale} for n in (8, 16)]
    return {"sweep": "seq_len", "mode": "train", "config": config, "points": points}

  a, b = tmp_path / "a.json", tmp_path / "b.json"
  a.write_text(json.dumps(sweep("configs/x_rnn.py", "rnn_attention", 0.2)))
  b.write_text(json.dumps(sweep("configs/x_tf.py", "transformer", 0.1)))
  bench.plot_saved_sweeps([str(a), str(b)], str(tmp_path / "both.png"))
  assert (tmp_path / "both.png").read_bytes()[:4] == b"\x89PNG"
  assert "plot:" in capsys.readouterr().out
  (tmp_path / "c.json").write_text(json.dumps({"mode": "train"}))
  with pytest.raises(bench.Stop, match="c.json: not a --sweep JSON"):
    bench.plot_saved_sweeps([str(a), str(tmp_path / "c.json")], str(tmp_path / "x.png"))
  other = dict(sweep("configs/y.py", "transformer", 0.1), sweep="batch")
  (tmp_path / "d.json").write_text(json.dumps(other))
  with pytest.raises(bench.Stop, match="sweep different things"):
    bench.plot_saved_sweeps([str(a), str(tmp_path / "d.json")], str(tmp_path / "x.png"))


def test_train_json_has_every_field(runs):
  import bench
  proc, folder = runs("train")
  _ok(proc)
  record = json.loads((folder / "train.json").read_text())
  assert set(bench.TRAIN_FIELDS) <= set(record)
  assert record["mode"] == "train" and record["config"] == "configs/tiny.py"
  assert record["batch_size"] == 4 and record["seq_len"] == 8 and record["num_devices"] == 1
  assert record["parallelism"] == "mesh" and record["dtype"] == "float32"
  assert record["peak_source"] == "measured" and record["peak_flops_per_s"] > 0
  assert 0 < record["step_time_p10_s"] <= record["step_time_s"] <= record["step_time_p90_s"]
  assert record["tokens_per_s"] == pytest.approx(2 * 4 * 8 / record["step_time_s"])
  cfg = _model_cfg(vocab_size=64, d_model=64, d_ff=128, num_heads=4, num_layers=1)
  assert record["model_flops_per_step"] == flops.train_flops(cfg, 4, 8, 8)
  assert record["mfu"] == pytest.approx(
      record["model_flops_per_step"] / record["step_time_s"] / record["peak_flops_per_s"])
  assert record["peak_memory_bytes"] is None or record["peak_memory_bytes"] > 0
  assert "tokens_per_s" in proc.stdout and "mfu" in proc.stdout


def test_decode_json(runs):
  import bench
  proc, folder = runs("decode")
  _ok(proc)
  record = json.loads((folder / "decode.json").read_text())
  assert set(bench.DECODE_FIELDS) <= set(record)
  assert record["mode"] == "decode" and record["decode_cache"] is True
  assert record["decode_len"] == 5 and record["beam_size"] == 2 and record["num_devices"] == 1
  assert record["sent_per_s"] == pytest.approx(4 / record["step_time_s"])
  assert record["out_tokens_per_s"] == pytest.approx(5 * record["sent_per_s"])


def test_uncached_greedy_decode(runs):
  proc, folder = runs("decode_nocache")
  _ok(proc)
  record = json.loads((folder / "decode.json").read_text())
  assert record["decode_cache"] is False and record["beam_size"] == 1
  assert record["out_tokens_per_s"] == pytest.approx(3 * record["sent_per_s"])


def test_sweep_devices_writes_plot(runs):
  proc, folder = runs("sweep")
  _ok(proc)
  data = json.loads((folder / "sweep.json").read_text())
  assert data["sweep"] == "devices"
  assert [(p["parallelism"], p["num_devices"]) for p in data["points"]] == [("mesh", 1),
                                                                            ("mesh", 2)]
  assert all(p["batch_size"] == 4 and p["tokens_per_s"] > 0 for p in data["points"])
  png = folder / "sweep.png"
  assert data["plot"] == str(png) and png.read_bytes()[:4] == b"\x89PNG"
  assert "sweep: devices" in proc.stdout
