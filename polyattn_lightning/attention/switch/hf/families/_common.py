"""What the Hugging Face adapters share: their registry, the masks HF models build themselves, the heads' layout."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn
from transformers.cache_utils import EncoderDecoderCache

from ...base import SwitchedAttention, register_adapter
from ..masks import split_mask

#: HF attention class -> its adapter; filled by :func:`hf_adapter` when a family module is imported.
HF_ADAPTERS: dict[type[nn.Module], type[SwitchedAttention]] = {}


def hf_adapter(hf_class: type[nn.Module]):
    """Register the decorated ``SwitchedAttention`` subclass of ``hf_class`` as its switch, in :data:`HF_ADAPTERS`
    (:func:`~polyattn_lightning.attention.switch.base.register_adapter`)."""
    return register_adapter(hf_class, HF_ADAPTERS)


class HFSwitched(SwitchedAttention):
    """The mixin of the HF adapters: their dropout is passed to ``_attend`` (HF names it ``dropout``,
    ``attn_dropout`` or ``attention_dropout``), and an adapter may refuse a configuration it cannot express."""

    def refusal(self) -> str | None:
        """Why this module cannot be switched (a configuration the adapter does not express), or None."""
        return None

    def dropout_p(self, dropout: nn.Dropout | float) -> float:
        """``dropout``'s probability in training mode, 0 in eval mode."""
        p = dropout.p if isinstance(dropout, nn.Dropout) else float(dropout)
        return p if self.training else 0.0


def own_mask(mask: Tensor | None) -> tuple[bool, dict[str, Tensor]]:
    """A mask an HF model built itself (``create_bidirectional_mask`` / ``create_causal_mask`` with its eager or
    SDPA implementation, DeBERTa's 0/1 pairs): bool or integer nonzero = attend, float 0 = keep (``finfo.min``)
    as ``(is_causal, masks)`` for ``attention()`` (:func:`~..masks.split_mask`: causal and padding forms become
    ``is_causal`` and ``key_padding_mask``)."""
    return (False, {}) if mask is None else split_mask(allowed_by(mask))


def allowed_by(mask: Tensor) -> Tensor:
    """The pairs an HF model's own mask lets attend (bool True; a float mask's 0 entries, an integer's nonzero)."""
    return mask == 0 if mask.is_floating_point() else mask.bool()


def cached_key_values(
    module: nn.Module,
    states: Tensor,
    cache,
    cross_attention: bool,
    project: Callable[[Tensor], tuple[Tensor, Tensor]],
    kwargs: dict,
) -> tuple[Tensor, Tensor]:
    """k, v of a BERT-style attention layer with HF's cache steps (MegatronBERT, RoFormer, as BERT has them): a
    cross-attention layer's cached k, v once its cache was filled, else ``project(states)`` stored in the cache."""
    current, updated = cache, False
    if isinstance(cache, EncoderDecoderCache):
        updated = cache.is_updated.get(module.layer_idx)
        current = cache.cross_attention_cache if cross_attention else cache.self_attention_cache
    if cross_attention and cache is not None and updated:
        layer = current.layers[module.layer_idx]
        return layer.keys, layer.values
    key, value = project(states)
    if cache is not None:
        key, value = current.update(key, value, module.layer_idx, kwargs=kwargs)
        if cross_attention and isinstance(cache, EncoderDecoderCache):
            cache.is_updated[module.layer_idx] = True
    return key, value


def split_heads(x: Tensor, head_dim: int) -> Tensor:
    """``(B, L, H * d)`` -> ``(B, H, L, d)``."""
    return x.view(*x.shape[:-1], -1, head_dim).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    """``(B, H, L, d)`` -> ``(B, L, H * d)``."""
    return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], -1)


__all__ = [
    "HFSwitched",
    "HF_ADAPTERS",
    "allowed_by",
    "cached_key_values",
    "hf_adapter",
    "merge_heads",
    "own_mask",
    "split_heads",
]
