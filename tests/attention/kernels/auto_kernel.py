"""What ``kernel="auto"`` picks, through the public ``kernel_choice`` (the kernel tests ask it for many inputs)."""
from __future__ import annotations

from polyattn_lightning.attention import kernel_choice


def auto_kernel(q, activation, k=None, v=None, **options) -> str:
    """The kernel ``attention(q, k, v, activation, **options)`` runs with ``kernel="auto"`` (k, v default to q, k)."""
    k = q if k is None else k
    return kernel_choice(q, k, k if v is None else v, activation, **options).kernel
