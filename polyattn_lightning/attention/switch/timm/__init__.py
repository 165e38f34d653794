"""Switch the attention of a timm model to a registry activation, in place.

Reached through the one door, :func:`polyattn_lightning.attention.set_attention`; the switch itself is
``switching.py``. Each attention module timm
built gets its class swapped for a subclass whose ``forward`` is timm's own except that the softmax goes
through :func:`~polyattn_lightning.attention.attention`. Swapping the class (rather than wrapping the module)
keeps every parameter where it was, so the state_dict keys are timm's and a timm checkpoint loads before or
after the switch. Calling it again re-switches (``softmax`` runs on SDPA, so switching back to softmax gives
timm's outputs).

Three kinds of switch (the support table of docs/reference/timm-models.md, made by ``python -m
polyattn_lightning.bench timm-support``, lists per timm model module what switches):

* the generic one (``sdpa.py``): classes that run on SDPA, on a reviewed list (class, mask kinds); timm's
  forward runs with SDPA rebound in its globals, so RoPE, q/k norms, biases and layouts stay timm's;
* hand-written adapters (``families/``, one module per timm family), where timm's SDPA call or softmax needs
  more than that (Swin's 0/-100 shift mask added to its position bias, hand-computed softmax);
* refusals (``tables.py``): attention that is not softmax over dot products of tokens is named and left
  alone; attention pooling heads stay softmax by decision and are named in a log line.

Each switch of the first two kinds was reviewed against its timm class's code in given timm releases
(``switch/reviewed.py``): a class whose installed code was not reviewed keeps softmax, named with its timm
release and what to do (refused under ``strict``, like any attention that cannot be switched).

A model counts as switched only on evidence: a probe forward after the switch (``switching.py`` says how).

To add a timm family: the recipe is ``families/__init__.py``'s.
"""

from .... import deprecated
from .switching import AttentionRefused, ProbeInputError, Unswitched, set_attention, switch_modules


def __getattr__(name: str):
    """Names that moved to the modules of this package: where to (``polyattn_lightning/deprecated.py``)."""
    return deprecated.attribute(__name__, name)


__all__ = ["AttentionRefused", "ProbeInputError", "Unswitched", "set_attention", "switch_modules"]
