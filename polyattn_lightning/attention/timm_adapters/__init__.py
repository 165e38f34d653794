"""Explicit switches for timm attention classes that compute softmax by hand (one module per timm family).

``set_attention`` imports this package so that every module in it registers its
adapters with ``@_adapts`` (see ``polyattn_lightning.attention.timm_patch``).
"""
from . import (  # noqa: F401
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
    swin_v2,
    tnt,
    volo,
)
