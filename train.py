"""Trains a translation model.

    python train.py --config=configs/default.py --workdir=/tmp/tiny
    python train.py --config=configs/multi30k.py --workdir=runs/m30k --config.num_train_steps=20000

Re-running the same command resumes from the newest checkpoint in `<workdir>/checkpoints`.
SIGTERM / SIGINT finish the current step, save, and exit 0; a process still running
`stop_timeout_s` (600) seconds later is hung and exits with status 128 + signal, without a new
save. Several hosts: run one process per host with --coordinator_address=host:port
--num_processes=N --process_id=i.
"""

from __future__ import annotations

import os
import pathlib
import sys

if __name__ == "__main__":  # first, before JAX starts its threads: see training/host_memory.py
  from training.host_memory import keep_freed_memory

  keep_freed_memory()

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "Config file (configs/*.py).", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints, metrics, vocabulary go.")
_COORD = flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-host).")
_NPROC = flags.DEFINE_integer("num_processes", None, "Number of processes (multi-host).")
_PID = flags.DEFINE_integer("process_id", None, "This process's index (multi-host).")
_DIST_TIMEOUT = flags.DEFINE_integer(
  "distributed_timeout", 300, "Seconds to wait for the coordinator before giving up."
)
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  workdir = pathlib.Path(_WORKDIR.value).absolute()
  from training.loop import Stop, check_workdir, train

  try:
    check_workdir(workdir)
    from training.parallel import initialize_distributed

    initialize_distributed(_COORD.value, _NPROC.value, _PID.value, _DIST_TIMEOUT.value)
    train(_CONFIG.value, workdir)
  except (Stop, ValueError, FileNotFoundError, RuntimeError) as e:
    if isinstance(e, (ValueError, FileNotFoundError, RuntimeError)) and os.environ.get(
      "TRAIN_DEBUG"
    ):
      raise
    sys.stderr.write(f"train.py: error: {e}\n")
    sys.exit(1)


if __name__ == "__main__":
  from configs.flags import parse

  app.run(main, flags_parser=parse)
