"""What bench.py prints and writes: one record as `field  value` lines, a sweep or a paired run as
a table, and any of them as JSON (--json).
"""

from __future__ import annotations

import json
import pathlib

from core.errors import ArgumentError
from core.progress import fmt

# What a field of the printed record is measured over, where that is easy to mistake.
FIELD_NOTES = {
  "achieved_flops_per_s": "all devices",
  "peak_flops_per_s": "one device",
  "peak_flops_per_s_total": "all devices",
  "mfu": "achieved / peak total",
}


def print_record(record: dict) -> None:
  width = max(map(len, record))
  for key, value in record.items():
    note = f"  ({FIELD_NOTES[key]})" if key in FIELD_NOTES and value is not None else ""
    print(f"{key:<{width}}  {fmt(value)}{note}")


def print_sweep(records: list[dict], kind: str) -> None:
  train = records[0]["mode"] == "train"
  columns = [
    "parallelism",
    "num_devices",
    "batch_size",
    "seq_len",
    "compile_s",
    "step_time_s",
    "step_time_p10_s",
    "step_time_p90_s",
  ]
  columns += ["tokens_per_s", "mfu"] if train else ["sent_per_s", "out_tokens_per_s"]
  if not train:
    columns.remove("parallelism")
  print(f"sweep: {kind}")
  print_table(columns, records)


def print_round(i: int, rounds: int, record: dict) -> None:
  """One line per child process of --separate_processes, as its record comes."""
  print(
    f"round {i + 1}/{rounds}: {record.get('implementation')} "
    f"{fmt(record.get('step_time_s'))} s/step (host memory "
    f"{record.get('host_memory')})",
    flush=True,
  )


def print_paired(result: dict) -> None:
  rate = "tokens_per_s" if result["mode"] == "train" else "sent_per_s"
  columns = ["implementation", "step_time_s", "step_time_p10_s", "step_time_p90_s", rate]
  columns += ["mfu"] if result["mode"] == "train" else []
  where = "a process per side and round" if result["separate_processes"] else "one process"
  print(
    f"paired: {result['rounds']} rounds of {result['steps_per_round']} steps each ({where}), "
    f"{result['mode']}, {result['records'][0]['device_kind']}, "
    f"{result['records'][0]['dtype']}"
  )
  print_table(
    columns + (["host_memory"] if result["separate_processes"] else []), result["records"]
  )
  first = {"implementation": result["records"][1]["implementation"], **result}
  for peer in result.get("peer_speedups", [first]):
    name = "flax" if peer["implementation"] == "flax examples/wmt" else peer["implementation"]
    print(
      f"speedup ({name}'s step time / ours) {fmt(peer['speedup'])}, per round "
      f"{fmt(peer['speedup_min'])}-{fmt(peer['speedup_max'])}"
    )


def print_table(columns: list[str], records: list[dict]) -> None:
  """One right-aligned row per record, under a header of the column names."""
  cells = [[fmt(r.get(c)) for c in columns] for r in records]
  widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
  print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
  for row in cells:
    print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def write_json(path: str | pathlib.Path, data) -> None:
  """Writes `data` as indented JSON to `path`, making its folder."""
  path = pathlib.Path(path)
  try:
    path.write_text(json.dumps(data, indent=2) + "\n")
  except OSError as e:
    raise ArgumentError("path", path, f"cannot write: {e.strerror or e}") from None
