"""Switch a Hugging Face ``transformers`` model's attention to a registry activation, through transformers' own door.

``switching.py``: :func:`set_attention` (the interface or an adapter per module, proven by a probe forward) and
:func:`load_pretrained`; ``interface.py``: the ``AttentionInterface`` function, preconditions and one call of
``attention()``; ``masks.py`` and ``extras.py``: what HF passes it; ``families/``: the adapters; ``classes.py``: the
switched classes; ``saved/``: what a saved folder carries and what loads it; ``probe.py``: the probe's inputs;
``cache.py``: :class:`RecurrentCache`, generation from a fixed-size state. This package imports transformers;
nothing else in the project does unless it is given an HF model.
"""

from .... import deprecated
from .cache import RecurrentCache
from .classes import PREFIX, switched_class, switched_class_named
from .interface import IMPLEMENTATION, polyattn_attention
from .masks import split_mask
from .probe import PROBE_TOKENS, probe_inputs
from .saved import CONFIG_KEY, mark_config, write_remote_code
from .switching import load_pretrained, set_attention


def __getattr__(name: str):
    """Unpickling finds a switched class (``Switched__...``) here by its name; a moved name says where it went."""
    return switched_class_named(name) if name.startswith(PREFIX) else deprecated.attribute(__name__, name)


__all__ = [
    "CONFIG_KEY",
    "IMPLEMENTATION",
    "PROBE_TOKENS",
    "RecurrentCache",
    "load_pretrained",
    "mark_config",
    "polyattn_attention",
    "probe_inputs",
    "set_attention",
    "split_mask",
    "switched_class",
    "write_remote_code",
]
