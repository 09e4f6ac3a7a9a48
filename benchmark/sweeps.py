"""One benchmark repeated over device counts (pmap and mesh), sequence lengths or batch sizes:
the sweep's points, every one's config checked before the first runs, their records (a sweep that
fails part-way still writes the points done, and the error, to its JSON) and their plot; and the
plot of several saved sweeps together. On a CPU, bench.py simulates 8 devices for a devices sweep
(they share the host's cores).
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Callable

import jax
from absl import logging
from matplotlib.figure import Figure
from matplotlib.ticker import ScalarFormatter

from benchmark.report import print_sweep, write_json
from benchmark.timing import check_config
from core.errors import ArgumentError

SWEEP_DEFAULTS = {
  "devices": [1, 2, 4, 8],
  "seq_len": [16, 32, 64, 128, 256],
  "batch": [4, 8, 16, 32],
}


def sweep_configs(
  config, kind: str, values: list[str] | None, modes=("pmap", "mesh"), mode: str = "train"
):
  """(value, parallelism, config) of every point of sweep `kind` ('devices': for each
  parallelism in `modes`). Checks every point's config (`check_config`) first and raises
  UsageError naming all the points that cannot run. `mode`: 'train' or 'decode'."""
  try:
    numbers = [int(v) for v in values] if values else list(SWEEP_DEFAULTS[kind])
  except ValueError:
    raise ArgumentError("values", ",".join(values), "expected integers") from None
  if not numbers or any(v < 1 for v in numbers):
    raise ArgumentError("values", ",".join(map(str, numbers)), "expected positive integers")
  points = []

  def with_(**fields):
    c = config.copy_and_resolve_references()
    c.update_from_flattened_dict(fields)
    return c

  if kind == "devices":
    available = jax.local_device_count()
    too_many = [n for n in numbers if n > available]
    if too_many:
      if values:
        asked = f"{too_many} device(s) asked for, this process has {available}"
        raise ArgumentError("values", ",".join(values), asked)
      logging.warning("devices sweep: skipping %s (only %d devices)", too_many, available)
      numbers = [n for n in numbers if n <= available]
    for parallelism in modes:
      if parallelism not in ("pmap", "mesh"):
        raise ArgumentError("modes", ",".join(modes), f"{parallelism!r} is not pmap or mesh")
    for parallelism in modes:
      for n in numbers:
        points.append((n, parallelism, with_(parallelism=parallelism, num_devices=n)))
  elif kind == "seq_len":
    limit = int(config.model.max_len)
    if values and max(numbers) > limit:
      raise ArgumentError(
        "values", ",".join(values), f"{max(numbers)} is longer than model.max_len={limit}"
      )
    numbers = [n for n in numbers if n <= limit]
    points = [(n, config.parallelism, with_(**{"bench.seq_len": n})) for n in numbers]
  else:
    points = [(n, config.parallelism, with_(**{"bench.batch_size": n})) for n in numbers]
  # Every point's config is checked (data-parallel split, mesh shape, lengths...) before any runs.
  bad: dict[str, list[str]] = {}  # error -> the points it stops
  for value, parallelism, c in points:
    try:
      check_config(c, mode)
    except ValueError as e:  # UsageError, or training.parallel's mesh errors
      where = (
        f"{parallelism} num_devices={value}"
        if kind == "devices"
        else f"bench.{'seq_len' if kind == 'seq_len' else 'batch_size'}={value}"
      )
      bad.setdefault(str(e), []).append(where)
  if bad:
    count = sum(map(len, bad.values()))
    raise ArgumentError(
      "kind",
      kind,
      f"{count} of {len(points)} points cannot run (none was run): "
      + "; ".join(f"{', '.join(where)}: {e}" for e, where in bad.items()),
    )
  return points


def run_points(points, one, kind: str, mode: str, json_path: str | None) -> list[dict]:
  """Runs `one(config)` for each sweep point (value, parallelism, config); returns the records.
  If a point fails (an error, out of memory, Ctrl-C), the points done so far are written to
  `json_path` with the error (`complete` false, no plot) before the error goes on."""
  records = []
  value = parallelism = None
  try:
    for value, parallelism, c in points:
      logging.info("sweep %s=%s (%s)", kind, value, parallelism)
      records.append({"sweep_value": value, **one(c)})
  except (Exception, KeyboardInterrupt) as e:
    if json_path:
      write_json(
        json_path,
        {
          "sweep": kind,
          "mode": mode,
          "config": records[0]["config"] if records else None,
          "plot": None,
          "complete": False,
          "error": f"{kind}={value} ({parallelism}): {type(e).__name__}: {e}",
          "points": records,
        },
      )
      logging.error(
        "the %s sweep failed at %s=%s (%s); the %d point(s) done are in %s",
        kind,
        kind,
        value,
        parallelism,
        len(records),
        json_path,
      )
    raise
  return records


def run_sweep(
  config,
  kind: str,
  mode: str,
  one: Callable[[object], dict],
  values: list[str] | None = None,
  modes=("pmap", "mesh"),
  json_path: str | None = None,
  plot: str | None = None,
) -> None:
  """The sweep `kind`: runs `one(config)` (one benchmark's record) at every point, prints their
  table, plots them to `plot` (default: `json_path` with .png, else bench_<kind>.png) and writes
  the sweep to `json_path`. `values`, `modes`: as `sweep_configs` takes them."""
  if kind == "devices" and mode != "train":
    raise ArgumentError("kind", kind, "needs mode 'train' (decoding runs on one device)")
  points = sweep_configs(config, kind, values, modes, mode)
  if not points:
    raise ArgumentError("kind", kind, "no point to run")
  if kind == "devices" and jax.default_backend() == "cpu":
    logging.warning(
      "simulated CPU devices share this host's %d cores: expect no speed-up, and "
      "an MFU that falls as devices are added",
      os.cpu_count() or 0,
    )
  records = run_points(points, one, kind, mode, json_path)
  print_sweep(records, kind)
  plot_path = pathlib.Path(
    plot or (pathlib.Path(json_path).with_suffix(".png") if json_path else f"bench_{kind}.png")
  )
  name = pathlib.Path(records[0]["config"] or "config").stem
  title = f"{name}: {mode}, {records[0]['device_kind']}, {records[0]['dtype']}"
  if kind == "devices":
    title += f", batch {config.bench.batch_size}, seq_len {config.bench.seq_len}"
  plot_sweep(records, kind, plot_path, title)
  print(f"plot: {plot_path}")
  if json_path:
    write_json(
      json_path,
      {
        "sweep": kind,
        "mode": mode,
        "config": records[0]["config"],
        "plot": str(plot_path),
        "complete": True,
        "points": records,
      },
    )


def plot_sweep(
  records: list[dict], kind: str, path: pathlib.Path, title: str, label_of=None
) -> None:
  """Step time (median, p10–p90 bars) and throughput against the swept value, one line per
  `label_of(record)` (default: the parallelism for device sweeps, else the mode)."""
  x_key = {"devices": "num_devices", "seq_len": "seq_len", "batch": "batch_size"}[kind]
  rate_key = "tokens_per_s" if records[0]["mode"] == "train" else "sent_per_s"
  groups: dict[str, list[dict]] = {}
  if label_of is None:
    label_of = lambda r: r["parallelism"] if kind == "devices" else r["mode"]
  for r in records:
    groups.setdefault(label_of(r), []).append(r)
  fig = Figure(figsize=(11, 4.2))  # no pyplot: nothing global, the Agg canvas writes the PNG
  left, right = fig.subplots(1, 2)
  for label, rs in groups.items():
    xs = [r[x_key] for r in rs]
    median = [r["step_time_s"] for r in rs]
    err = [
      [m - r["step_time_p10_s"] for m, r in zip(median, rs)],
      [r["step_time_p90_s"] - m for m, r in zip(median, rs)],
    ]
    left.errorbar(xs, median, yerr=err, marker="o", capsize=3, label=label)
    right.plot(xs, [r[rate_key] for r in rs], marker="o", label=label)
  for ax, ylabel in ((left, "step time (s), median, p10–p90"), (right, rate_key)):
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r[x_key] for r in records}))
    ax.get_xaxis().set_major_formatter(ScalarFormatter())
    ax.set_xlabel(x_key)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def plot_saved_sweeps(paths: list[str], plot: str) -> None:
  """One plot of several saved sweeps (JSON files at `paths`) of the same kind (e.g. the seq_len
  sweeps of two model types), one line per config file."""
  sweeps = []
  for path in paths:
    try:
      data = json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError) as e:
      raise ArgumentError("paths", path, f"cannot read a sweep JSON: {e}") from None
    if not isinstance(data, dict) or "sweep" not in data or not data.get("points"):
      raise ArgumentError("paths", path, "not a sweep JSON (no 'sweep' and 'points')")
    sweeps.append(data)
  kinds = {d["sweep"] for d in sweeps}
  if len(kinds) != 1:
    differ = f"the files sweep different things: {sorted(kinds)}"
    raise ArgumentError("paths", ",".join(paths), differ)
  records = []
  for d in sweeps:
    name = pathlib.Path(d.get("config") or "config").stem
    records += [
      dict(r, _label=f"{name} ({r['model_type']})" if r.get("model_type") else name)
      for r in d["points"]
    ]
  kind = kinds.pop()
  first = records[0]
  plot_sweep(
    records,
    kind,
    pathlib.Path(plot),
    f"{first['mode']}, {first['device_kind']}, {first['dtype']}, batch {first['batch_size']}",
    label_of=lambda r: r["_label"],
  )
  print(f"plot: {plot}")
