"""Switch the attention of a timm model to a registry activation, in place.

Reached through the one door, :func:`polyattn_lightning.attention.set_attention`; the switch itself is
``switching.py``. Each attention module timm
built gets its class swapped for a subclass whose ``forward`` is timm's own except that the softmax goes
through :func:`~polyattn_lightning.attention.attention`. Swapping the class (rather than wrapping the module)
keeps every parameter where it was, so the state_dict keys are timm's and a timm checkpoint loads before or
after the switch. Calling it again re-switches (``softmax`` runs on SDPA, so switching back to softmax gives
timm's outputs).

Three kinds of switch (the README's support table, made by ``python -m polyattn_lightning.bench timm-support``,
lists per timm model module what switches):

* the generic one (``sdpa.py``): classes that run on SDPA, on a reviewed list (class, mask kinds); timm's
  forward runs with SDPA rebound in its globals, so RoPE, q/k norms, biases and layouts stay timm's;
* hand-written adapters (``families/``, one module per timm family), where timm's SDPA call or softmax needs
  more than that (Swin's 0/-100 shift mask added to its position bias, hand-computed softmax);
* refusals (``tables.py``): attention that is not softmax over dot products of tokens is named and left
  alone; attention pooling heads stay softmax by decision and are named in a log line.

Each switch of the first two kinds was reviewed against its timm class's code in given timm releases
(``switch/reviewed.py``): a class whose installed code was not reviewed keeps softmax, named with its timm
release and what to do (refused under ``strict``, like any attention that cannot be switched).

A model counts as switched only on evidence: after switching, ``set_attention`` runs a probe forward (one
random image at the size the model was built for) under a ``TorchFunctionMode`` that records every softmax and
SDPA call (``probe.py``); any call outside a switched module, any module with timm's ``fused_attn`` flag (its
mark on SDPA attention) but no switch, and any module of a class the tables name refuses the model with each
module's path, class (``timm.models.beit.Attention``) and reason, and nothing is changed. ``strict=False``
(YAML: ``model.init_args.attention_strict: false``) switches what can be switched and logs one line naming
what stays softmax.

To add a timm family:

1. timm calls SDPA for it (with ``fused_attn`` on) and does no other softmax: read its ``forward``, note what
   it passes as ``attn_mask`` (nothing, a bool mask, a float bias, ``-inf``/``finfo.min`` sentinels -- never a
   finite sentinel mixed with a bias) and add a ``Reviewed(cls, masks)`` line to ``sdpa.REVIEWED``; add its
   tiny constructor to ``tests/attention/switch/timm_families.py``.
2. timm computes softmax by hand: write the smallest subclass of the timm class with
   :class:`~polyattn_lightning.attention.switch.base.SwitchedAttention` whose ``forward`` keeps timm's steps
   and calls ``self._attend`` where the softmax was, decorate it with ``@register_adapter(TimmClass)``, put it
   in ``families/<family>.py`` (listed in ``families/__init__.py``) and take the class off
   ``tables.HAND_SOFTMAX``.
3. Regenerate the support table: ``python -m polyattn_lightning.bench timm-support --write README.md``.
"""

from .switching import AttentionRefused, ProbeInputError, Unswitched, set_attention, switch_modules

__all__ = ["AttentionRefused", "ProbeInputError", "Unswitched", "set_attention", "switch_modules"]
