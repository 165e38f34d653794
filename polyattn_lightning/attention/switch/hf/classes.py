"""The switched classes of the modules the interface reached: HF's class with the project's
:class:`~polyattn_lightning.attention.switch.base.SwitchedAttention` mixin (its forward unchanged), one per class.

Each is named ``Switched__<HF module path>__<class>`` and lives, for pickle, in the package
``polyattn_lightning.attention.switch.hf``, whose ``__getattr__`` rebuilds it from the HF class it names
(:func:`switched_class_named`): a switched model pickled in one process unpickles in another, and the pickles of
earlier releases name the same path.
"""

from __future__ import annotations

import sys

from torch import nn

from ..base import SwitchedAttention
from . import interface

interface.register()  # a switched model unpickled in a new process finds its attention function registered

#: The module the classes say they live in (the package: it rebuilds them when unpickling asks).
HOME = "polyattn_lightning.attention.switch.hf"
PREFIX = "Switched__"
_switched: dict[type[nn.Module], type[SwitchedAttention]] = {}

#: ``SwitchedAttention.map_layout`` of the interface classes whose rows are not ``B`` token sequences.
MAP_LAYOUTS = {"transformers.models.swin.modeling_swin.SwinAttention": "shifted_windows"}


def switched_class(cls: type[nn.Module]) -> type[SwitchedAttention]:
    """``SwitchedAttention`` + the HF class (its forward unchanged), one per class, picklable by name."""
    if cls not in _switched:
        qualified = f"{cls.__module__}.{cls.__qualname__}"
        name = PREFIX + qualified.replace(".", "__")
        namespace = {"__module__": HOME, "__qualname__": name, "map_layout": MAP_LAYOUTS.get(qualified, "tokens")}
        _switched[cls] = type(name, (SwitchedAttention, cls), namespace)
    return _switched[cls]


def switched_class_named(name: str) -> type[SwitchedAttention]:
    """The switched class a pickle names (``Switched__transformers__models__bert__...``), rebuilt from its HF class."""
    if not name.startswith(PREFIX):
        raise AttributeError(f"module {HOME!r} has no attribute {name!r}")
    module_name, _, qualname = name[len(PREFIX) :].replace("__", ".").rpartition(".")
    __import__(module_name)
    return switched_class(getattr(sys.modules[module_name], qualname))


__all__ = ["MAP_LAYOUTS", "switched_class", "switched_class_named"]
