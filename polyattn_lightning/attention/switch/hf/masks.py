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
  Doge's its dynamic bias, Falcon's (ALiBi configs, transformers 5.25 on) ``alibi / sqrt(d)`` (plus ``finfo.min``
  where a mask masks, found by equality: :func:`~polyattn_lightning.attention.masks.split_sentinels`); Swin's is
  its relative-position bias plus the 0/-100 shift mask, so the bias is recomputed from the module's own table and
  subtracted, which leaves the shift mask exactly (``(b + 0) - b == 0`` in floating point; ``(b - 100) - b`` is
  not 0).

ALiBi's bias is ``-slope_h * (i - j)`` for query ``i`` and key ``j``. Falcon and BLOOM pass ``slope_h * position_j``
(the key's position among the real tokens), which equals it only up to ``slope_h * position_i``, a constant per row
that softmax's shift invariance removes. Softmax takes HF's values as they are (its outputs are HF's); every other
activation takes the relative form (:func:`relative_alibi`), since ``phi(S + c)`` is not ``phi(S)`` for an
elementwise ``phi`` (docs/howto/switch-hf.md says so). :data:`ABSOLUTE_ALIBI` names the interface classes whose
mask carries it.
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


def relative_alibi(bias: Tensor, num_queries: int) -> Tensor:
    """``b_ij - b_i,(i + Nk - Nq)``: HF's ``slope * position_j`` made ``slope * (position_j - position_i)`` (query
    ``i`` is key ``i + Nk - Nq``, as with a cache); ``bias`` ``(B, H, 1 or Nq, Nk)`` -> ``(B, H, Nq, Nk)``."""
    batch, heads, _, num_keys = bias.shape
    bias = bias.expand(batch, heads, num_queries, num_keys)
    own = torch.arange(num_queries, device=bias.device) + (num_keys - num_queries)
    return bias - bias.gather(-1, own.view(1, 1, -1, 1).expand(batch, heads, num_queries, 1))


def _bias_and_sentinels(module: nn.Module, mask: Tensor) -> tuple[Tensor, Tensor]:
    """A score bias with ``finfo.min`` where masked: BEiT (and DiT, built from BEiT's classes) adds its
    relative-position bias to the padding mask (``BeitLayer.forward``, ``BeitModel.forward``); Doge fills its
    dynamic mask (a learned bias per key, ``dt_states``) with ``finfo.min`` (``prepare_dynamic_mask``); Falcon
    with ALiBi fills ``alibi / sqrt(d)`` with it where the causal mask masks (``FalconModel.forward``)."""
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
    "transformers.models.falcon.modeling_falcon.FalconAttention": _bias_and_sentinels,
}
#: The classes of :data:`MASK_BIASES` whose model adds the bias to the mask it built (BEiT's
#: ``relative_position_bias + attention_mask``): they attend with HF's float masks (0 keeps), since a boolean mask,
#: which HF builds where it cannot skip the mask (padding, or while ``torch.export`` traces), adds 1 to every kept
#: score: nothing to softmax, a different model to every other activation.
BIAS_ADDED_TO_MASK = frozenset({"transformers.models.beit.modeling_beit.BeitAttention"})
#: The classes of :data:`MASK_BIASES` whose bias is HF's absolute ALiBi (module docstring): a non-softmax activation
#: gets its relative form. Falcon's float mask carries a bias only in ALiBi configs (rotary ones pass bool masks).
ABSOLUTE_ALIBI = frozenset({"transformers.models.falcon.modeling_falcon.FalconAttention"})


def _qualified_names(module: nn.Module):
    """``module.qualified.ClassName`` of ``module``'s class and its bases (a switched class names HF's)."""
    return (f"{cls.__module__}.{cls.__qualname__}" for cls in type(module).__mro__)


def mask_bias_of(module: nn.Module) -> Callable[[nn.Module, Tensor], tuple[Tensor, Tensor]] | None:
    """The split of ``module``'s float mask, for a class on :data:`MASK_BIASES` or a subclass (a switched one)."""
    return next((MASK_BIASES[name] for name in _qualified_names(module) if name in MASK_BIASES), None)


def adds_bias_to_mask(model: nn.Module) -> bool:
    """Whether a module of ``model`` is of a class of :data:`BIAS_ADDED_TO_MASK` (or a subclass)."""
    return any(not BIAS_ADDED_TO_MASK.isdisjoint(_qualified_names(module)) for module in model.modules())


def interface_masks(module: nn.Module, mask: Tensor, softmax: bool = False) -> tuple[bool, dict[str, Tensor]]:
    """What the interface function passes ``attention()`` for ``module``'s ``attention_mask`` when ``module``
    attends with softmax or not: ``(is_causal, masks)``, ``masks`` holding ``attn_mask`` / ``key_padding_mask`` /
    ``attn_bias`` (module docstring)."""
    split = mask_bias_of(module) if mask.is_floating_point() else None
    if split is None:
        return split_mask(mask)
    allowed, bias = split(module, mask)
    if not softmax and not ABSOLUTE_ALIBI.isdisjoint(_qualified_names(module)):
        bias = relative_alibi(bias, mask.shape[-2])
    if torch.compiler.is_compiling():
        return False, {"attn_mask": allowed, "attn_bias": bias}
    if bool(allowed.all()):
        return False, {"attn_bias": bias}
    causal, masks = split_mask(allowed)
    return causal, {**masks, "attn_bias": bias}


__all__ = [
    "ABSOLUTE_ALIBI",
    "BIAS_ADDED_TO_MASK",
    "MASK_BIASES",
    "adds_bias_to_mask",
    "interface_masks",
    "mask_bias_of",
    "relative_alibi",
    "split_mask",
]
