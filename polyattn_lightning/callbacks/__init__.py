"""Task-agnostic callbacks for long cluster runs; importing this package makes their short names usable in YAML."""
from .attention_maps import AttentionMaps
from .attention_norms import AttentionNorms
from .nan_guard import NonFiniteLossError, NonFiniteLossGuard
from .predictions import PredictionWriter
from .preemption import SlurmPreemption
from .resume import ExactResume

__all__ = [
    "AttentionMaps", "AttentionNorms", "ExactResume", "NonFiniteLossError", "NonFiniteLossGuard", "PredictionWriter",
    "SlurmPreemption",
]
