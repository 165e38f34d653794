"""Registry attention: softmax replaced by polynomial, ReLU, SoftPlus, sigmoid... activations."""
from .functional import KERNELS, attention
from .registry import (
    Activation,
    ActivationSpec,
    describe,
    get_activation,
    register_activation,
    registered_activations,
)

__all__ = [
    "Activation",
    "ActivationSpec",
    "KERNELS",
    "attention",
    "describe",
    "get_activation",
    "register_activation",
    "registered_activations",
]
