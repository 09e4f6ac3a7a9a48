"""Translating with a trained workdir: `from inference import Translator`
(`quiet_library_logs()`: the command lines' quiet, for Python users who want it)."""

from core.logs import quiet_library_logs
from inference.translator import Translations, Translator

__all__ = ["Translator", "Translations", "quiet_library_logs"]
