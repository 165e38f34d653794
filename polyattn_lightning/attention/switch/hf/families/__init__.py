"""Explicit switches for Hugging Face attention classes outside ``AttentionInterface`` (one module per family).

These classes compute their softmax by hand or call ``F.scaled_dot_product_attention`` themselves, so
``set_attn_implementation`` does not reach them. Each adapter is the smallest subclass of HF's class whose
``forward`` keeps HF's steps (projections, caches, rotary embeddings, HF's own position-bias helpers) and calls
``self._attend`` where the softmax was, with what HF added to the scores as ``attn_bias`` and what it masked as
masks; HF's modules stay unpatched (an instance's class is swapped, its parameters and ``state_dict`` keys are
HF's). Adapted (transformers 5.x; module -- class -- score bias / mask / temperature):

* ``deberta`` -- DeBERTa and DeBERTa-v2 ``DisentangledSelfAttention``: c2p + p2c as a score bias,
  ``1 / sqrt(d * (1 + #position types))``;
* ``mpnet`` -- ``MPNetSelfAttention``: the relative bias;
* ``roformer`` -- ``RoFormerSelfAttention``: rotary q, k (v), ``1 / sqrt(d)``;
* ``bert_eager`` -- BERT's attention computed by hand: ``MegatronBertSelfAttention``, ``RemBertSelfAttention``,
  ``TapasSelfAttention``, ``VisualBertSelfAttention``: ``1 / sqrt(d)``, encoder or decoder masks;
* ``data2vec_vision`` -- ``Data2VecVisionSelfAttention`` (eager, SDPA): the relative-position bias;
* ``swinv2`` -- ``Swinv2SelfAttention``: cosine attention, the logit scale in q, the continuous position bias, the
  shift mask;
* ``gpt_neo`` -- ``GPTNeoSelfAttention._attn``: global or local causal, temperature 1;
* ``alibi`` -- ``FalconAttention``, ``BloomAttention``: ALiBi (relative form for non-softmax activations) or
  rotary.

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

from torch import nn

from ...base import SwitchedAttention
from ...mha import SwitchedMultiheadAttention
from ...reviewed import ADAPTER, adapter_route
from ._common import HF_ADAPTERS, HFSwitched

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
        importlib.import_module(f"{__name__}.{family}")
    adapter = HF_ADAPTERS[cls]
    return adapter if adapter_route(cls, adapter) == ADAPTER else None


__all__ = ["FAMILY_MODULES", "HFSwitched", "adapter_for"]
