"""Trains a translation model.

    python train.py --config=configs/default.py --workdir=/tmp/tiny
    python train.py --config=configs/multi30k.py --workdir=runs/m30k --config.num_train_steps=20000

Re-running the same command resumes from the newest checkpoint in `<workdir>/checkpoints`.
SIGTERM / SIGINT finish the current step, save, and exit 0; a process still running
`stop_timeout_s` (600) seconds later is hung and exits with status 128 + signal, without a new
save. Several hosts: run one process per host with --coordinator_address=host:port
--num_processes=N --process_id=i (or nothing, where JAX detects the cluster: SLURM, Open MPI,
Kubernetes, Cloud TPU); when one process is lost (killed, frozen) the others exit with status 1
within --heartbeat_timeout (30) seconds, naming it. Exit status 2: bad usage or input; 1: a
failure while running.
"""

from __future__ import annotations

import pathlib

if __name__ == "__main__":  # first, before JAX starts its threads: see cli/host_memory.py
  from cli.host_memory import keep_freed_memory_on_cpu

  keep_freed_memory_on_cpu()

from absl import flags  # noqa: E402

from cli import app, coordination_service  # noqa: E402
from cluster import distributed  # noqa: E402
from core.errors import UsageError  # noqa: E402
from core.rules import Int  # noqa: E402
from training import finetune  # noqa: E402
from training.loop import train  # noqa: E402
from training.validate import check_config  # noqa: E402
from training.workdir import check_workdir  # noqa: E402


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """This command line's flags, defined only when it runs (cli/app.py)."""
  define = dict(flag_values=flag_values)
  app.define_config(flag_values)
  flags.adopt_module_key_flags(app, flag_values=flag_values)  # --config, --show_config in --help
  flags.DEFINE_string("workdir", None, "Where checkpoints, metrics, vocabulary go.", **define)
  flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-host).", **define)
  flags.DEFINE_integer("num_processes", None, "Number of processes (multi-host).", **define)
  flags.DEFINE_integer("process_id", None, "This process's index (multi-host).", **define)
  flags.DEFINE_integer(
    "distributed_timeout", 300, "Seconds to wait for the coordinator before giving up.", **define
  )
  flags.DEFINE_integer(
    "heartbeat_timeout",
    distributed.HEARTBEAT_S,
    "Several processes: seconds a process may show no sign of life (killed, crashed, frozen, its "
    "host down) before the others stop, naming it, with exit status 1.",
    **define,
  )
  flags.DEFINE_boolean(
    "take_over_lock",
    False,
    "Take <workdir>/lock from the run that holds it, alive or not (make sure it is stopped); a "
    "dead holder's lock is taken over without this flag.",
    **define,
  )
  flags.mark_flag_as_required("config", flag_values=flag_values)
  for name, rule in (
    ("num_processes", Int(min=1)),
    ("process_id", Int(min=0)),
    ("distributed_timeout", Int(min=1)),
    ("heartbeat_timeout", Int(min=2)),
  ):
    app.check_flag(name, rule, flag_values)


def main() -> None:
  f = flags.FLAGS
  config = app.load_config()
  if not f.workdir:
    raise UsageError("--workdir is required: where checkpoints, metrics and the vocabulary go")
  workdir = pathlib.Path(f.workdir).absolute()
  check_config(config, "train")  # before the workdir is created
  finetune.resolve(config, workdir)  # and config.init_from's source
  check_workdir(workdir)
  distributed.initialize_distributed(
    f.coordinator_address,
    f.num_processes,
    f.process_id,
    f.distributed_timeout,
    f.heartbeat_timeout,
    service_command=coordination_service.command(),
  )
  try:
    train(config, workdir, take_over_lock=f.take_over_lock)
  except Exception as e:
    distributed.stop_after_error(e)  # several processes: a lost one is named instead
    raise
  distributed.finish()


if __name__ == "__main__":
  define_flags()
  app.run(
    main,
    prog="train.py",
    flag_names={"timeout_s": "distributed_timeout", "heartbeat_s": "heartbeat_timeout"},
  )
