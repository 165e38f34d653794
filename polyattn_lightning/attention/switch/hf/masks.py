"""Hugging Face's attention masks as ``attention()`` takes them best."""

from __future__ import annotations

import torch
from torch import Tensor

from ...masks import causal_mask


def split_mask(mask: Tensor) -> tuple[bool, dict[str, Tensor]]:
    """HF's mask as ``attention()`` takes it best: ``(is_causal, masks)``.

    A boolean mask that is causal (bottom-right) and/or key padding is passed as ``is_causal`` plus a
    ``key_padding_mask``, so the kernels skip the tiles above the diagonal and the padding and poly1 keeps its
    linear form; anything else (sliding window, chunks, an additive float mask) stays ``attn_mask``. The last
    query row sees every key either pattern allows, so it is the padding. Under ``torch.compile`` (no
    data-dependent test) the mask is passed as it is.
    """
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or torch.compiler.is_compiling():
        return False, {"attn_mask": mask}
    row = mask[:, :, -1:]
    padding = {} if bool(row.all()) else {"key_padding_mask": ~row[:, 0, 0]}
    if bool((mask == row).all()):
        return False, padding
    if bool((mask == (causal_mask(*mask.shape[-2:], mask.device) & row)).all()):
        return True, padding
    return False, {"attn_mask": mask}
