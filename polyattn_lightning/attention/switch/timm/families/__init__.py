"""Explicit switches for timm attention classes the generic SDPA switch cannot take (one module per timm family).

Each module registers its adapters with ``@register_adapter(TimmClass)``
(:func:`polyattn_lightning.attention.switch.base.register_adapter`) when this package imports it (the list at
the bottom: add a new family's module there). Each adapter is the smallest subclass of timm's class: projections,
norms, pooling and
position terms are timm's (its helpers where it has them); only ``softmax(S) @ v``
goes through ``attention()`` (``SwitchedAttention._attend``), so the fused kernels,
masks and the ``capture`` hook apply. N below is the length ``N`` of the scales.

To add a timm family:

1. timm calls SDPA for it (with ``fused_attn`` on) and does no other softmax: read its ``forward``, note what
   it passes as ``attn_mask`` (nothing, a bool mask, a float bias, ``-inf``/``finfo.min`` sentinels -- never a
   finite sentinel mixed with a bias) and add a ``Reviewed(cls, masks)`` line to ``sdpa.REVIEWED``; add its
   tiny constructor to ``tests/attention/switch/timm_families.py``.
2. timm computes softmax by hand: write the smallest subclass of the timm class with
   :class:`~polyattn_lightning.attention.switch.base.SwitchedAttention` whose ``forward`` keeps timm's steps
   and calls ``self._attend`` where the softmax was, decorate it with ``@register_adapter(TimmClass)``, put it
   in ``families/<family>.py`` (listed at the bottom of this file) and take the class off
   ``tables.HAND_SOFTMAX``.
3. Regenerate the support table:
   ``python -m polyattn_lightning.bench timm-support --write docs/reference/timm-models.md``.

Adapted (timm 1.0.31; family module: class -- score bias / mask / N):

* ``swin``: ``swin_transformer.WindowAttention`` -- relative-position bias as ``attn_bias``; the 0/-100 shift
  mask (which timm adds to the bias) as ``attn_mask``, N = the window's unmasked keys.
* ``swin_v2``: ``swin_transformer_v2.WindowAttention`` and ``swin_transformer_v2_cr.WindowMultiHeadAttention``
  -- cosine attention, the clamped logit scale a per-head temperature folded into q; bias
  ``16 sigmoid(cpb_mlp)`` (V2) or the meta-MLP's (V2-CR); the 0/-100 shift mask: masked pairs zero,
  N = the window's unmasked keys.
* ``cait``: ``cait.TalkingHeadAttn`` -- talking heads, ``phi`` between ``proj_l`` and ``proj_w``
  (materialised, fp32); N = the tokens. ``capture`` sees the mixed scores (see ``_common.talking_heads``).
* ``efficientformer_v2``: ``Attention2d`` -- talking heads with attention biases, N = the tokens of the
  (strided) map; ``Attention2dDownsample`` -- biases, Nq = the half-resolution grid, N = Nk = the input's.
* ``crossvit``: ``crossvit.CrossAttention`` -- the class token queries, N = the tokens.
* ``csatv2``: ``csatv2.SpatialTransformerBlock`` -- timm's softmax runs over the batch (``(B, N) @ (N, B)``),
  kept as timm has it: N = the batch size (see the module).
* ``mvitv2``: ``mvitv2.MultiScaleAttention`` -- the q-dependent relative-position term as a full bias
  with its gradient; N = the pooled keys.
* ``levit``: ``levit.Attention``, ``levit.AttentionDownsample`` (linear and conv layouts) -- attention
  biases; the downsampling one has Nq < Nk, N = Nk.
* ``efficientformer``: ``efficientformer.Attention`` -- attention biases, N = the tokens.
* ``efficientvit_msra``: ``efficientvit_msra.CascadedGroupAttention`` -- one ``attention()`` per head
  (cascaded), biases, N = the window (timm's zero padding included, as softmax has it).
* ``convit``: ``convit.GPSA`` -- the content map switched, the positional softmax kept, the gate as
  timm's (decision in the module); ``convit.MHSA``.
* ``gcvit``: ``gcvit.WindowAttentionGlobal`` -- relative-position bias, local or global query, N = the window.
* ``tnt``: ``tnt.Attention`` -- inner (pixels of a patch) and outer (patches) attention.
* ``volo``: ``volo.ClassAttention`` -- the class-attention blocks, N = the tokens.
* ``channel_attention``: ``davit.ChannelAttention``, ``davit.ChannelAttentionV2``,
  ``edgenext.CrossCovarianceAttn`` -- ``d x d`` channel maps, N = the head's channels.
* ``shvit``: ``shvit.SHSA`` -- single head over the positions.
* ``byoanet``: ``timm.layers`` ``BottleneckAttn`` (BoTNet) and ``HaloAttn`` (HaloNet) -- the
  q-dependent relative-position logits as a full bias; Halo: N = the halo window (padding included).

Hand-computed softmax in timm 1.0.31 that is not adapted, and why:

* no dot-product map over tokens: ``coat.FactorAttnConvRelPosEnc`` (softmax of k over tokens, then
  ``k^T v``: factorised, linear), ``volo.OutlookAttention`` (weights predicted by a linear layer),
  ``mobilevit.LinearSelfAttention`` (linear attention), ``layers.LambdaLayer`` (softmax of keys),
  ``layers.GlobalContext`` (softmax pooling by a 1x1 conv), ``layers.SelectiveKernelAttn`` /
  ``layers.SplitAttn`` (softmax over branches), ``efficientvim.HSMSSD`` and the head weights of
  ``efficientvim`` (a state-space mixer, learned mixing weights);
* built by no registered model: ``layers.NonLocalAttn`` (``attn_layer='nl'`` on request only),
  ``layers.MultiQueryAttentionV2``, ``mvitv2.MultiScaleAttentionPoolFirst`` (``pool_first``; its
  1.0.31 forward also fails: q times an untransposed k) -- ``switch/timm/tables.py``'s ``HAND_SOFTMAX`` refuses them
  by class;
* outside ``forward``: ``convit``'s ``get_attention_map`` methods (timm's own softmax diagnostics).

The classes with an SDPA path (``fused_attn``: BEiT, EVA, MaxViT, PVT v2, Twins, DaViT's windows,
VOLO's self-attention...) and ``DiffAttention`` are the generic switch's (``switch/timm/sdpa.py``); attention
pooling heads stay softmax by decision (``switch/timm/tables.py``'s ``POOLING_HEADS``).

An adapter whose map is not over tokens sets ``map_layout`` (``"channels"``, ``"shifted_windows"``), which the
attention-map pictures read.
"""

from . import (  # noqa: F401  (each registers its adapters)
    byoanet,
    cait,
    channel_attention,
    convit,
    crossvit,
    csatv2,
    efficientformer,
    efficientformer_v2,
    efficientvit_msra,
    gcvit,
    levit,
    mvitv2,
    shvit,
    swin,
    swin_v2,
    tnt,
    volo,
)
