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

:func:`adapter_for` (``_common.py``) finds a class's adapter.

Each adapter was reviewed against its HF class's code in given transformers releases (``switch/reviewed.py``,
``reviewed.json``): :func:`adapter_for` refuses a class whose installed code was not reviewed, and hands a class
that calls the ``AttentionInterface`` itself in the installed release (``FalconAttention`` from 5.25 on) to the
interface. An adapter lists in ``relies_on`` the library code beyond its class's methods that it depends on.
"""

from ._common import FAMILY_MODULES, HF_ADAPTERS, HFSwitched, adapter_for

__all__ = ["FAMILY_MODULES", "HFSwitched", "HF_ADAPTERS", "adapter_for"]
