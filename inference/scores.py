"""The former name of inference/metrics.py, kept for inference/ctranslate2_translate.py until its
command line moves to cli/: `score` is `corpus_metrics`, `Scores` is `Metrics`."""

from inference.metrics import Metrics as Scores
from inference.metrics import corpus_metrics as score

__all__ = ["Scores", "score"]
