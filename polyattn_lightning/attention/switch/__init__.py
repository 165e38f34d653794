"""The one door for every model: ``set_attention(model, "poly3")`` (``door.py``) switches its attention in place.

One folder per library, ``timm/`` and ``hf/``; what they share: ``base.py`` (:class:`~.base.SwitchedAttention`, the
``capture`` contract, :func:`~.base.register_adapter`), ``recorder.py`` (the softmax recorder that proves a switch),
``mha.py`` (PyTorch's ``nn.MultiheadAttention``, in any model). The door imports a library only for its models
(``import polyattn_lightning`` imports neither); no module here imports a kernel: they all call ``attention()``. To
switch a new library's models, add a folder here with its ``set_attention`` and route its models to it in the door.
"""

from ... import deprecated
from .base import (
    ADAPTERS,
    AttentionInputs,
    Capture,
    SwitchedAttention,
    attention_map,
    attention_modules,
    register_adapter,
)
from .door import set_attention

#: The timm switch's refusal types, imported (with timm) on first use.
_LAZY = dict.fromkeys(("AttentionRefused", "ProbeInputError", "Unswitched"), "polyattn_lightning.attention.switch.timm")


def __getattr__(name: str):
    return deprecated.attribute(__name__, name, _LAZY)


__all__ = [
    "ADAPTERS",
    "AttentionInputs",
    "AttentionRefused",
    "Capture",
    "ProbeInputError",
    "SwitchedAttention",
    "Unswitched",
    "attention_map",
    "attention_modules",
    "register_adapter",
    "set_attention",
]
