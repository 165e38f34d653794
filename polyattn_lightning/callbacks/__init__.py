"""Task-agnostic callbacks for long cluster runs; importing this package makes their short names usable in YAML."""
from .nan_guard import NonFiniteLossError, NonFiniteLossGuard
from .predictions import PredictionWriter
from .resume import ExactResume

__all__ = ["ExactResume", "NonFiniteLossError", "NonFiniteLossGuard", "PredictionWriter"]
