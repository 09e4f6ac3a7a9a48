"""Benchmarks the real train step (or decoding) on synthetic batches: step time, throughput, MFU.

    python bench.py --config=configs/wmt14_ende_base.py --json=base.json
    python bench.py --config=configs/tiny.py --config.model.vocab_size=8000 --mode=decode
    python bench.py --config=configs/tiny.py --config.model.vocab_size=8000 --sweep=devices \
        --json=devices.json   # also writes devices.png
    python bench.py --config=configs/bench_tiny.py --flax_wmt=flax-0.12.8/examples/wmt --paired
    python bench.py --config=configs/bench_tiny.py --mode=decode --ctranslate2 --paired

Batches are `bench.batch_size` × `bench.seq_len` random tokens; decoding always produces
`bench.decode_len` tokens (beam `bench.beam_size`). MFU is achieved model FLOP/s over the peak of
all devices (datasheet, else a measured matmul: `peak_source`). --flax_wmt=<dir> times google/flax
examples/wmt instead of ours; --ctranslate2 (--mode=decode) times CTranslate2 decoding our model's
own weights, at the first of --ctranslate2_compute_types, in each of its threadings on this
machine's cores (one replica on all, or one per core), recording the fastest and its matrix
library (`CT2_USE_MKL=0|1` picks another); --paired times ours and the peer(s) alternately
(every compute type and threading a peer; with flax's, --separate_processes runs each side in
its own process every round). The work is in benchmark/ (its modules' docstrings say how).
"""

from __future__ import annotations

import os
import sys

from cli.host_memory import DEFAULT, keep_freed_memory_on_cpu


def _simulate_cpu_devices(argv: list[str]) -> None:
  """--sweep=devices on a CPU needs several devices; XLA makes them only if told before JAX is
  imported. (The flag changes nothing on GPUs and TPUs.)"""
  wants = "--sweep=devices" in argv or any(
    a == "--sweep" and b == "devices" for a, b in zip(argv, argv[1:])
  )
  flag = "--xla_force_host_platform_device_count"
  if wants and flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {flag}=8").strip()


# Whether this process keeps freed host memory (cli/host_memory.py; reported as `host_memory`):
# run as a script on the CPU it does, set before JAX starts its threads.
HOST_MEMORY = DEFAULT
if __name__ == "__main__":
  _simulate_cpu_devices(sys.argv)
  HOST_MEMORY = keep_freed_memory_on_cpu()

from absl import flags  # noqa: E402

from cli import app  # noqa: E402
from cli import bench as command  # noqa: E402
from cli.bench import FLAG_NAMES, main  # noqa: E402


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """cli/bench.py's flags, shown by --help as this script's own."""
  command.define_flags(flag_values)
  flags.adopt_module_key_flags(command, flag_values=flag_values)


if __name__ == "__main__":
  define_flags()
  app.run(lambda: main(HOST_MEMORY), prog="bench.py", flag_names=FLAG_NAMES)
