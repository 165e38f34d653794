"""The dtype policy of non-softmax attention: scores and ``phi(S)`` in fp32, also under autocast.

``x^3`` of a bf16 score loses most of its mantissa and overflows fp16 at ``|S| > 40``; every kernel
therefore computes in :func:`compute_dtype` with autocast off (:func:`autocast_off`) and casts the output
back to the inputs' dtype.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import Tensor


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype of non-softmax scores and ``phi(S)``: fp32 for fp16/bf16/fp32 inputs, fp64 for fp64 (gradcheck)."""
    return torch.promote_types(x.dtype, torch.float32)


def autocast_off(device_type: str):
    """Autocast off for the fp32 scores of a non-softmax activation; a no-op context when it is off already (the
    common case: entering ``torch.autocast`` costs about as much as a decoding step's kernel call)."""
    return torch.autocast(device_type, enabled=False) if torch.is_autocast_enabled(device_type) else nullcontext()
