"""LightningModules; importing this package makes their short names usable in YAML."""
from .classification import ClassificationModule, MixupRecipe, Recipe
from .lra import LRAModule
from .models import create_timm_model
from .optim import OptimRecipe

__all__ = ["ClassificationModule", "LRAModule", "MixupRecipe", "OptimRecipe", "Recipe", "create_timm_model"]
