"""What a ``save_pretrained`` folder of a switched model carries: its activation, and the implementation it loads with.

:func:`~..switching.set_attention` writes the spec into ``config.polyattn_attention`` (:data:`CONFIG_KEY`), so a
``save_pretrained`` folder carries it; :func:`~..switching.load_pretrained` loads such a folder and switches it back. A
model switched to another activation than softmax also names an ``attn_implementation`` (:func:`mark_config`) that
transformers accepts only where this package registered it, so loading the folder in a process without the project
fails (``Specified attn_implementation="polyattn" is not supported``) instead of silently computing softmax with the
trained weights:

* a model switched through the ``AttentionInterface`` alone names the implementation it was switched to
  (:data:`~..interface.IMPLEMENTATION`, or :data:`~..interface.EAGER_MASKS_IMPLEMENTATION` for the models without
  SDPA); where the project is imported (the name registers with transformers then:
  :mod:`polyattn_lightning.hf_registration`), a plain ``AutoModel.from_pretrained(folder)`` loads it switched, the
  attention function reading the activation from the module's config;
* a model with modules switched by the project's adapters (Falcon, DeBERTa, BLOOM...: ``families/``) names
  :data:`LOAD_PRETRAINED`, which is never registered: their code does not call the interface, so a plain load would
  compute softmax; it is refused everywhere, with the name saying what loads it, ``load_pretrained``.

:func:`~..switching.load_pretrained` loads every such folder and switches it back.
"""

from __future__ import annotations

from ....registry import ActivationSpec, get_activation
from ..interface import CONFIG_KEY, IMPLEMENTATION, SAVED_IMPLEMENTATION_KEY

#: The implementation a folder of a model with adapter-switched modules names: registered nowhere, so transformers
#: refuses a plain ``from_pretrained`` of it, its message naming the function that loads it.
LOAD_PRETRAINED = "polyattn_lightning_load_pretrained"


def mark_config(config, activation: ActivationSpec, implementation: str = IMPLEMENTATION) -> None:
    """Name ``implementation`` as the ``attn_implementation`` a ``save_pretrained`` folder of a model switched to
    ``activation`` is loaded with, unless ``activation`` is softmax (such a folder loads anywhere, as the same
    softmax). transformers pops the key when it reads the config back; the attention's first call on a model loaded
    so puts it back (``interface._spec_of``), as the ``trust_remote_code`` loader does (:mod:`.standalone`)."""
    if get_activation(activation).is_softmax:
        vars(config).pop(SAVED_IMPLEMENTATION_KEY, None)
    else:
        setattr(config, SAVED_IMPLEMENTATION_KEY, implementation)


__all__ = ["CONFIG_KEY", "LOAD_PRETRAINED", "SAVED_IMPLEMENTATION_KEY", "mark_config"]
