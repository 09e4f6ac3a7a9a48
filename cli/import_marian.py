"""The command line of the Marian / OPUS-MT importer (formats/marian.py):

    python -m cli.import_marian --model=opus-mt-en-de.zip --workdir=runs/opus-en-de

writes an ordinary workdir (config, vocab.json, a step-0 checkpoint) that decode.py, the
Translator, `python -m cli.ctranslate2_export` and fine-tuning (`--config.init_from`) read.
Whatever the release holds that cannot be imported exactly is refused in one line before
anything is written.
"""

from __future__ import annotations

from absl import flags

from cli import app
from formats.marian import FOLLOW, convert, write_workdir
from formats.marian_files import read_release


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """This command line's flags, defined only when it runs (cli/app.py)."""
  define = dict(flag_values=flag_values)
  flags.DEFINE_string(
    "model", None, "A Marian / OPUS-MT release: its folder or zip file.", required=True, **define
  )
  flags.DEFINE_string(
    "workdir", None, "The workdir to write (new or empty).", required=True, **define
  )
  flags.DEFINE_enum(
    "follow",
    "marian",
    list(FOLLOW),
    "marian: Marian's own computation; ctranslate2: CTranslate2's Marian converter's position "
    "table and LayerNorm epsilon (to compare with its output).",
    **define,
  )


def main() -> None:
  imported = convert(read_release(flags.FLAGS.model), follow=flags.FLAGS.follow)
  workdir = write_workdir(imported, flags.FLAGS.workdir)
  opts = imported.model_options
  print(
    f"imported {flags.FLAGS.model} into {workdir}: {opts['num_layers']} layers, d_model "
    f"{opts['d_model']}, {imported.vocab.vocab_size} ids (decode.py searches as Marian: "
    f"--length_penalty=marian)"
  )


if __name__ == "__main__":
  define_flags()
  app.run(main, prog="cli.import_marian")
