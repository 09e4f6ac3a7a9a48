"""A trained Transformer workdir as a CTranslate2 model directory (inference/ctranslate2_export.py):

    python -m cli.ctranslate2_export --workdir=runs/m30k --output=m30k_ct2 \
        [--checkpoint=latest|<step>|average:<k>] [--quantization=int8]
"""

from __future__ import annotations

from absl import flags

from cli import app
from inference.ctranslate2_export import export
from inference.ctranslate2_translate import QUANTIZATIONS


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """This command line's flags, defined only when it runs (cli/app.py)."""
  flags.DEFINE_string("workdir", None, "Training workdir.", required=True, flag_values=flag_values)
  flags.DEFINE_string(
    "output",
    None,
    "The CTranslate2 model directory to write (new or empty).",
    required=True,
    flag_values=flag_values,
  )
  flags.DEFINE_string(
    "checkpoint",
    "latest",
    "latest, a step number or average:<k> (the mean of the last k).",
    flag_values=flag_values,
  )
  flags.DEFINE_enum(
    "quantization",
    None,
    list(QUANTIZATIONS),
    "Store the weights quantized (default float32); a Translator may still compute in "
    "another type (its compute_type).",
    flag_values=flag_values,
  )


def main() -> None:
  f = flags.FLAGS
  path = export(f.workdir, f.output, f.checkpoint, f.quantization)
  print(f"wrote the CTranslate2 model {path} ({f.quantization or 'float32'} weights)")


if __name__ == "__main__":
  define_flags()
  app.run(main, prog="cli.ctranslate2_export")
