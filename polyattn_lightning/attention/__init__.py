"""Registry attention: softmax replaced by polynomial, ReLU, SoftPlus, sigmoid... activations.

The op: :func:`attention` (``functional.py``; decoding too: a KV-cache step, or a step from a
:func:`recurrent_state`), the activation registry (``registry.py``), masks (``masks.py``), the dtype policy
(``dtypes.py``) and the fused forms every kernel reads (``forms.py``). Two rooms below it: ``kernels/`` (one module
per backend, and the ``pick()`` that chooses) and ``switch/`` (the one door, :func:`set_attention`). Where to add what:

* an activation: ``@register_activation`` (``registry.py``; a fused form also in ``forms.py``);
* a kernel backend: ``kernels/`` (its docstring has the recipe);
* a timm family: ``switch/timm/`` (its docstring has the recipe); an HF model: ``switch/hf/``.
"""

from .functional import attention, kernel_choice, recurrent_state
from .registry import Activation, ActivationSpec, describe, get_activation, register_activation, registered_activations
from .. import deprecated

#: Imported on first use: the switch imports a library only for its models.
_LAZY = {"KERNELS": f"{__name__}.kernels", "set_attention": f"{__name__}.switch"}
_LAZY.update(dict.fromkeys(("SwitchedAttention", "attention_modules", "register_adapter"), f"{__name__}.switch.base"))


def __getattr__(name: str):
    return deprecated.attribute(__name__, name, _LAZY)


__all__ = [
    "Activation",
    "ActivationSpec",
    "KERNELS",
    "SwitchedAttention",
    "attention",
    "attention_modules",
    "describe",
    "get_activation",
    "kernel_choice",
    "recurrent_state",
    "register_activation",
    "register_adapter",
    "registered_activations",
    "set_attention",
]
