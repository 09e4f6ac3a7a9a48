"""Translating with a trained workdir: `from inference import Translator`."""

from inference.translator import Translations, Translator

__all__ = ["Translator", "Translations"]
