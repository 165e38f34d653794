"""What the Hugging Face adapters share: their registry and its lookup, the masks HF models build themselves, the
heads' layout.

:data:`FAMILY_MODULES` names, per HF class, the module holding its adapter; :func:`adapter_for` imports it only
when a model holds that class, so switching a BERT imports none of these HF modeling modules. A module switched
before is its own adapter (switching again changes its activation).

Each adapter was reviewed against its HF class's code in given transformers releases (``switch/reviewed.py``,
``reviewed.json``): :func:`adapter_for` refuses a class whose installed code was not reviewed, and hands a class
that calls the ``AttentionInterface`` itself in the installed release (``FalconAttention`` from 5.25 on) to the
interface. An adapter lists in ``relies_on`` the library code beyond its class's methods that it depends on.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from torch import Tensor, nn
from transformers.cache_utils import EncoderDecoderCache

from ...base import SwitchedAttention, register_adapter
from ...mha import SwitchedMultiheadAttention
from ...reviewed import ADAPTER, adapter_route
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


#: ``transformers`` attention class (``module.qualname``) -> the family module here that adapts it.
FAMILY_MODULES = {
    "transformers.models.deberta.modeling_deberta.DisentangledSelfAttention": "deberta",
    "transformers.models.deberta_v2.modeling_deberta_v2.DisentangledSelfAttention": "deberta",
    "transformers.models.mpnet.modeling_mpnet.MPNetSelfAttention": "mpnet",
    "transformers.models.roformer.modeling_roformer.RoFormerSelfAttention": "roformer",
    "transformers.models.megatron_bert.modeling_megatron_bert.MegatronBertSelfAttention": "bert_eager",
    "transformers.models.rembert.modeling_rembert.RemBertSelfAttention": "bert_eager",
    "transformers.models.tapas.modeling_tapas.TapasSelfAttention": "bert_eager",
    "transformers.models.visual_bert.modeling_visual_bert.VisualBertSelfAttention": "bert_eager",
    "transformers.models.data2vec.modeling_data2vec_vision.Data2VecVisionSelfAttention": "data2vec_vision",
    "transformers.models.data2vec.modeling_data2vec_vision.Data2VecVisionSdpaSelfAttention": "data2vec_vision",
    "transformers.models.swinv2.modeling_swinv2.Swinv2SelfAttention": "swinv2",
    "transformers.models.gpt_neo.modeling_gpt_neo.GPTNeoSelfAttention": "gpt_neo",
    "transformers.models.falcon.modeling_falcon.FalconAttention": "alibi",
    "transformers.models.bloom.modeling_bloom.BloomAttention": "alibi",
}


def adapter_for(module: nn.Module) -> type[SwitchedAttention] | None:
    """The adapter of ``module``'s class (itself when already switched); PyTorch's ``nn.MultiheadAttention``
    included (``switch/mha.py``); None for any other class and for a class whose reviewed code in the installed
    release calls the interface. Raises :class:`~..reviewed.UnreviewedCode` for code not reviewed."""
    if isinstance(module, (HFSwitched, SwitchedMultiheadAttention)):
        return type(module)
    cls = type(module)
    if cls is nn.MultiheadAttention:
        adapter_route(cls, SwitchedMultiheadAttention)
        return SwitchedMultiheadAttention
    family = FAMILY_MODULES.get(f"{cls.__module__}.{cls.__qualname__}")
    if family is None:
        return None
    if cls not in HF_ADAPTERS:
        importlib.import_module(f"{__package__}.{family}")
    adapter = HF_ADAPTERS[cls]
    return adapter if adapter_route(cls, adapter) == ADAPTER else None


__all__ = [
    "FAMILY_MODULES",
    "HFSwitched",
    "HF_ADAPTERS",
    "adapter_for",
    "allowed_by",
    "cached_key_values",
    "hf_adapter",
    "merge_heads",
    "own_mask",
    "split_heads",
]
