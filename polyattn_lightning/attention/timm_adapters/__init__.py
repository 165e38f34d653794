"""Explicit switches for timm attention classes that compute softmax by hand (one module per timm family).

``set_attention`` imports this package so that every module in it registers its
adapters with ``@_adapts`` (see ``polyattn_lightning.attention.timm_patch``).
"""
