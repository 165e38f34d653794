"""Explicit switches for timm attention classes the generic SDPA switch cannot take, one module per timm family.

Importing this package imports each family's module, which registers its adapters
(:func:`polyattn_lightning.attention.switch.base.register_adapter`); a new family's module goes in the list below.
Which classes are adapted, what each passes to ``attention()``, what is left as timm has it and why, and how to add
a family: docs/reference/timm-adapters.md.
"""

from . import (  # noqa: F401  (each registers its adapters)
    byoanet,
    cait,
    channel_attention,
    convit,
    crossvit,
    csatv2,
    efficientformer,
    efficientformer_v2,
    efficientvit_msra,
    gcvit,
    levit,
    mvitv2,
    shvit,
    swin,
    swin_v2,
    tnt,
    volo,
)
