"""LightningModules, each on the contract of ``tasks/base.py``; importing this package makes their short names usable
in YAML.

``detection`` imports mmdet only when a DetectionModule is built, so other tasks never load it.
"""
from .base import TaskModule
from .classification import ClassificationModule, MixupRecipe, Recipe
from .detection import DetectionModule
from .lra import LRAModule
from .models import create_timm_model
from .optim import OptimRecipe

__all__ = ["ClassificationModule", "DetectionModule", "LRAModule", "MixupRecipe", "OptimRecipe", "Recipe", "TaskModule",
           "create_timm_model"]
