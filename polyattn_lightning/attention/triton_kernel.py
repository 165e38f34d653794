"""Fused Triton attention kernel for elementwise activations (CUDA)."""
from __future__ import annotations


def triton_supports(q, act) -> bool:
    return False
