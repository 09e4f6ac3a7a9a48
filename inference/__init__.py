"""Translating with a trained workdir: `from inference import Translator`
(`quiet_library_logs()`: the command lines' quiet, for Python users who want it).

`Translator` and `Translations` are imported on first use, so that a module of this package that
needs no JAX (inference/ctranslate2_translate.py, the CTranslate2 peer's path) imports none."""

from core.logs import quiet_library_logs

__all__ = ["Translator", "Translations", "quiet_library_logs"]


def __getattr__(name: str):
  if name in ("Translator", "Translations"):
    from inference import translator

    return getattr(translator, name)
  raise AttributeError(f"module 'inference' has no attribute {name!r}")
