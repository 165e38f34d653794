"""Hugging Face's attention masks as ``attention()`` takes them best, split by how each model builds them.

What reaches the interface function as ``attention_mask``:

* a boolean mask ``(B, 1, Q, KV)``, True = attend: what every model builds through the mask interface
  (padding, causal, sliding window, chunks), :func:`split_mask` turns its causal and padding forms into
  ``is_causal`` and ``key_padding_mask``;
* a float mask a model builds itself: 0 keeps, a negative value masks (``finfo.min``, ``-inf``, MarkupLM's
  ``-10000``: read by ``attention()`` as a mask, whatever its size);
* a float mask that also carries a score bias, for the classes on :data:`MASK_BIASES` (read in transformers'
  sources: the models that add a bias into the mask before the interface call). Their split follows how
  the model builds the sum, never a threshold on its values: BEiT's mask *is* its relative-position bias,
  Doge's its dynamic bias (plus ``finfo.min`` where a mask masks, found by equality:
  :func:`~polyattn_lightning.attention.masks.split_sentinels`); Swin's is its relative-position bias plus the
  0/-100 shift mask, so the bias is recomputed from the module's own table and subtracted, which leaves the
  shift mask exactly (``(b + 0) - b == 0`` in floating point; ``(b - 100) - b`` is not 0).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from ...masks import causal_mask, split_sentinels


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


def _bias_and_sentinels(module: nn.Module, mask: Tensor) -> tuple[Tensor, Tensor]:
    """A score bias with ``finfo.min`` where masked: BEiT (and DiT, built from BEiT's classes) adds its
    relative-position bias to the padding mask (``BeitLayer.forward``, ``BeitModel.forward``); Doge fills its
    dynamic mask (a learned bias per key, ``dt_states``) with ``finfo.min`` (``prepare_dynamic_mask``)."""
    return split_sentinels(mask)


def _swin(module: nn.Module, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Swin: ``relative_position_bias() + shift mask`` (``SwinAttention.forward``): the bias recomputed from the
    module's table, the rest is the 0/-100 shift mask (0 keeps), the same for every head."""
    bias = module.relative_position_bias().to(mask.dtype)
    return ((mask - bias) == 0)[:, :1], bias


#: ``module.qualified.ClassName`` of an HF attention class -> ``(allowed, score bias)`` of the float mask it
#: passes the interface (transformers 5.x sources).
MASK_BIASES: dict[str, Callable[[nn.Module, Tensor], tuple[Tensor, Tensor]]] = {
    "transformers.models.beit.modeling_beit.BeitAttention": _bias_and_sentinels,
    "transformers.models.doge.modeling_doge.DogeAttention": _bias_and_sentinels,
    "transformers.models.swin.modeling_swin.SwinAttention": _swin,
}


def mask_bias_of(module: nn.Module) -> Callable[[nn.Module, Tensor], tuple[Tensor, Tensor]] | None:
    """The split of ``module``'s float mask, for a class on :data:`MASK_BIASES` or a subclass (a switched one)."""
    for cls in type(module).__mro__:
        split = MASK_BIASES.get(f"{cls.__module__}.{cls.__qualname__}")
        if split is not None:
            return split
    return None


def interface_masks(module: nn.Module, mask: Tensor) -> tuple[bool, dict[str, Tensor]]:
    """What the interface function passes ``attention()`` for ``module``'s ``attention_mask``: ``(is_causal,
    masks)``, ``masks`` holding ``attn_mask`` / ``key_padding_mask`` / ``attn_bias`` (module docstring)."""
    split = mask_bias_of(module) if mask.is_floating_point() else None
    if split is None:
        return split_mask(mask)
    allowed, bias = split(module, mask)
    if torch.compiler.is_compiling():
        return False, {"attn_mask": allowed, "attn_bias": bias}
    if bool(allowed.all()):
        return False, {"attn_bias": bias}
    causal, masks = split_mask(allowed)
    return causal, {**masks, "attn_bias": bias}


__all__ = ["MASK_BIASES", "interface_masks", "mask_bias_of", "split_mask"]
