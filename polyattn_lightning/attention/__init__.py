"""Registry attention: softmax replaced by polynomial, ReLU, SoftPlus, sigmoid... activations."""
from .diagnostics import attention_norms
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
    "attention_norms",
    "describe",
    "get_activation",
    "register_activation",
    "registered_activations",
]
