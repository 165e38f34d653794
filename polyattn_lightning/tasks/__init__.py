"""LightningModules, each on the contract of ``tasks/base.py``; importing this package makes their short names usable
in YAML.

``detection`` imports mmdet only when a DetectionModule is built, so other tasks never load it; ``hf`` imports
transformers only when an HF model is built.
"""

from .. import deprecated
from .base import TaskModule
from .classification import ClassificationModule, MixupRecipe, Recipe
from .detection import DetectionModule
from .evaluation import logits_evaluation
from .hf import HFCausalLM, HFSequenceClassification
from .lra import LRAModule
from .optim import OptimRecipe

__all__ = [
    "ClassificationModule",
    "DetectionModule",
    "HFCausalLM",
    "HFSequenceClassification",
    "LRAModule",
    "MixupRecipe",
    "OptimRecipe",
    "Recipe",
    "TaskModule",
    "logits_evaluation",
]


def __getattr__(name: str):
    return deprecated.attribute(__name__, name)
