"""Task-agnostic callbacks for long cluster runs. The CLI adds the standard ones to every run under short keys
(``--nan_guard.on_nonfinite skip``: :mod:`.standard`); the opt-in ones go in ``trainer.callbacks`` by class
name or full path (``--trainer.callbacks+=AttentionMaps``; jsonargparse finds any imported Callback subclass)."""

from .attention_maps import AttentionMaps
from .attention_norms import AttentionNorms
from .ema import EMA
from .memory import MemoryReport
from .nan_guard import NonFiniteLossError, NonFiniteLossGuard
from .predictions import PredictionWriter
from .preemption import Interrupted, StopOnSignal
from .progress_lines import ProgressLines
from .resume import ExactResume
from .standard import LastCheckpoint
from .summary import RunSummary
from .. import deprecated

__all__ = [
    "AttentionMaps",
    "AttentionNorms",
    "EMA",
    "MemoryReport",
    "ExactResume",
    "Interrupted",
    "LastCheckpoint",
    "NonFiniteLossError",
    "NonFiniteLossGuard",
    "PredictionWriter",
    "ProgressLines",
    "RunSummary",
    "StopOnSignal",
]


def __getattr__(name: str):
    return deprecated.attribute(__name__, name)
