"""What a ``save_pretrained`` folder of a switched model carries: its activation, and the implementation it loads with.

:func:`~.switching.set_attention` writes the spec into ``config.polyattn_attention`` (:data:`CONFIG_KEY`), so a
``save_pretrained`` folder carries it; :func:`~.switching.load_pretrained` loads such a folder and switches it back. A
model switched to another activation than softmax also names :data:`~.interface.IMPLEMENTATION` as its
``attn_implementation`` (:func:`mark_config`): transformers accepts that name only where this package registered it,
so loading the folder in a process without the project fails (``Specified attn_implementation="polyattn" is not
supported``) instead of silently computing softmax with the trained weights, for the interface and the adapter
families alike. Where the project is imported, a plain ``AutoModel.from_pretrained`` does not switch it: an interface
family's first forward refuses (the attention function has no activation), GPT-Neo and Data2Vec-Vision do not build
(their classes index a table by the implementation's name), the other adapter families compute softmax until
``set_attention``; ``load_pretrained`` switches them all. (A folder that loads switched with ``trust_remote_code``
would register the name itself.)
"""

from __future__ import annotations

from ...registry import ActivationSpec, get_activation
from .interface import IMPLEMENTATION

#: The config attribute that stores the activation spec (saved by ``save_pretrained``).
CONFIG_KEY = "polyattn_attention"
#: The config attribute transformers reads back as the implementation to load a saved model with (:func:`mark_config`).
SAVED_IMPLEMENTATION_KEY = "attn_implementation"


def mark_config(config, activation: ActivationSpec) -> None:
    """Name :data:`IMPLEMENTATION` as the ``attn_implementation`` a ``save_pretrained`` folder of a model switched to
    ``activation`` is loaded with, unless ``activation`` is softmax (such a folder loads anywhere, as the same
    softmax). transformers pops the key when it reads the config back: the live config never keeps it."""
    if get_activation(activation).is_softmax:
        vars(config).pop(SAVED_IMPLEMENTATION_KEY, None)
    else:
        setattr(config, SAVED_IMPLEMENTATION_KEY, IMPLEMENTATION)


__all__ = ["CONFIG_KEY", "SAVED_IMPLEMENTATION_KEY", "mark_config"]
