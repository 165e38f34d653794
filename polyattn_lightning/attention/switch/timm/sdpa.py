"""The generic switch: timm's own ``forward``, with SDPA rebound to :func:`attention` in its globals only.

A timm attention class that runs on ``F.scaled_dot_product_attention`` (with ``fused_attn`` on) does
everything but the softmax itself: projections, head layout, q/k norms, RoPE, position biases,
dropout. Its switched subclass runs that very ``forward`` -- the function rebuilt from timm's code
object with globals in which ``F``, ``torch`` and ``nn`` (whatever names the timm module binds them
to) are stand-ins whose ``scaled_dot_product_attention`` is :func:`_sdpa`; every other attribute is
torch's own. Nothing module-level is patched: timm's modules, unswitched instances and every other
caller keep the real SDPA. ``fused_attn`` is forced on in switched modules (some classes default to
the hand-written softmax path, and ``TIMM_FUSED_ATTN=0`` turns it off everywhere).

:func:`_sdpa` maps SDPA's arguments onto ``attention()``'s without a data-dependent branch (no host
sync, no ``torch.compile`` graph break): a bool mask is ``attn_mask``; a float mask ``m`` is split into
a score bias ``m.masked_fill(m <= finfo.min / 2, 0)`` and ``allowed = m > finfo.min / 2`` (``-inf``
included), each only where the reviewed list says the class passes that kind; a class that passes only
a bias hands ``m`` over as ``attn_bias`` untouched (the review found no sentinel in it, so no pass over
it looks for one). ``is_causal`` is SDPA's, top-left (query ``i`` keeps keys ``0 .. i``): it goes to
``attention()``'s own ``is_causal`` where that means the same (``Nq == Nk``, every timm class that
passes it), so the kernels skip the tiles above the diagonal, and becomes a lower-triangular bool mask
otherwise. ``scale`` is the temperature (default ``d ** -0.5``).

:data:`REVIEWED` is the list: the class and the mask kinds it hands SDPA. A class is on it only if its
SDPA call *is* its attention: a float mask that mixes a bias with a finite sentinel (Swin's ``-100``, which
``x^3`` would not zero) keeps a class off, as does any softmax outside the SDPA call. The timm releases each
class's forward was read in are recorded as fingerprints of its code (``switch/reviewed.py``): a release that
changes a forward is refused by the door.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass

import timm.layers.attention as timm_attention
import timm.layers.attention2d as timm_attention2d
import timm.layers.diff_attention as timm_diff_attention
import timm.models.beit as beit
import timm.models.cait as cait
import timm.models.cpubone as cpubone
import timm.models.davit as davit
import timm.models.eva as eva
import timm.models.fastvit as fastvit
import timm.models.gemma4_vit as gemma4_vit
import timm.models.hiera as hiera
import timm.models.hieradet_sam2 as hieradet_sam2
import timm.models.iformer as iformer
import timm.models.lowformer as lowformer
import timm.models.maxxvit as maxxvit
import timm.models.metaformer as metaformer
import timm.models.nest as nest
import timm.models.nextvit as nextvit
import timm.models.pvt_v2 as pvt_v2
import timm.models.tiny_vit as tiny_vit
import timm.models.twins as twins
import timm.models.visformer as visformer
import timm.models.vision_transformer as vision_transformer
import timm.models.vision_transformer_relpos as vision_transformer_relpos
import timm.models.vision_transformer_sam as vision_transformer_sam
import timm.models.volo as volo
import timm.models.xcit as xcit
import torch
from torch import Tensor, nn

from ..base import ADAPTERS, SwitchedAttention

#: The kinds of ``attn_mask`` a class can hand SDPA: ``bool`` (True = attend), ``bias`` (a finite float
#: score bias, e.g. a relative-position bias) and ``sentinel`` (``-inf`` or ``finfo.min``: masked keys).
MASK_KINDS = frozenset({"bool", "bias", "sentinel"})


@dataclass(frozen=True)
class Reviewed:
    """One class of the generic switch: what its forward hands SDPA, as read in timm's source."""

    cls: type[nn.Module]
    masks: frozenset[str] = frozenset()  # empty: it never passes attn_mask (is_causal means SDPA's: no kinds)
    note: str = ""
    map_layout: str = "tokens"  # SwitchedAttention.map_layout of its switch

    def __post_init__(self):
        assert self.masks <= MASK_KINDS, self.masks

    @property
    def name(self) -> str:
        return f"{self.cls.__module__}.{self.cls.__qualname__}"


_ANY_MASK = frozenset({"bool", "bias", "sentinel"})  # masks a caller passes in (naflexvit's padding, a user's)
_BIAS = frozenset({"bias"})

#: The reviewed list (timm 1.0.31 sources).
REVIEWED = (
    Reviewed(
        timm_attention.Attention,
        _ANY_MASK,
        note="ViT, DeiT, deepseek_vit, naflexvit; attn_mask/is_causal from the caller",
    ),
    Reviewed(
        timm_attention.AttentionRope, _ANY_MASK, note="RoPE ViTs (naflexvit rope types); GQA heads expanded before SDPA"
    ),
    Reviewed(timm_diff_attention.DiffAttention, _ANY_MASK, note="both maps switched: phi(S1) v - lambda phi(S2) v"),
    Reviewed(
        vision_transformer.ParallelScalingBlock, _ANY_MASK, note="ViT parallel blocks (the block holds the attention)"
    ),
    Reviewed(vision_transformer.DiffParallelScalingBlock, _ANY_MASK, note="both maps switched"),
    Reviewed(timm_attention2d.MultiQueryAttention2d, _ANY_MASK, note="MobileNetV5 multi-query attention"),
    Reviewed(timm_attention2d.Attention2d, _ANY_MASK),
    Reviewed(eva.EvaAttention, _ANY_MASK, note="EVA/EVA02 (RoPE), qwen3_vit, naflexvit eva types"),
    Reviewed(beit.Attention, _BIAS, note="relative-position bias as attn_mask"),
    Reviewed(davit.WindowAttention),
    Reviewed(hiera.MaskUnitAttention, note="mask-unit windows: (B, heads, windows, tokens, d)"),
    Reviewed(hieradet_sam2.MultiScaleAttention),
    Reviewed(maxxvit.Attention2d, _BIAS, note="relative-position bias; SDPA through torch.nn.functional"),
    Reviewed(maxxvit.AttentionCl, _BIAS, note="relative-position bias; SDPA through torch.nn.functional"),
    Reviewed(pvt_v2.Attention, note="spatial-reduction keys"),
    Reviewed(twins.LocallyGroupedAttn),
    Reviewed(twins.GlobalSubSampleAttn, note="sub-sampled keys"),
    Reviewed(nest.Attention, note="blocks: (B, heads, blocks, tokens, d)"),
    Reviewed(tiny_vit.Attention, _BIAS, note="attention biases as attn_mask"),
    Reviewed(visformer.Attention, note="fused_attn off by default in timm"),
    Reviewed(vision_transformer_relpos.RelPosAttention, _BIAS, note="relative-position bias"),
    Reviewed(vision_transformer_sam.Attention, _BIAS, note="decomposed relative-position bias; (B * heads, N, d)"),
    Reviewed(metaformer.Attention),
    Reviewed(nextvit.EfficientAttention, note="sub-sampled keys"),
    Reviewed(cait.ClassAttn, note="CaiT and XCiT class attention: one query"),
    Reviewed(volo.Attention, note="VOLO's transformer stages (outlook and class attention are other classes)"),
    Reviewed(cpubone.ConvAttention),
    Reviewed(gemma4_vit.Gemma4Attention, frozenset({"sentinel"}), note="padding mask 0/-inf; scale=1 (q/k normed)"),
    Reviewed(iformer.SHMA),
    Reviewed(lowformer.ConvAttention),
    Reviewed(fastvit.Attention),
    Reviewed(
        xcit.XCA, note="the d x d channel map; learnable temperature folded into q (scale=1)", map_layout="channels"
    ),
)


# --------------------------------------------------------------------------- the SDPA stand-in

#: The switched modules whose forward is running, innermost last: :func:`_sdpa` attends for ``[-1]``.
_RUNNING: list[SwitchedAttention] = []


def _sdpa(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``F.scaled_dot_product_attention``'s signature and meaning, computed by the running module's activation."""
    module = _RUNNING[-1]
    kinds = module._sdpa_masks
    causal = False
    if is_causal:
        if attn_mask is not None:
            raise ValueError("scaled_dot_product_attention: attn_mask and is_causal cannot both be set")
        if query.shape[-2] == key.shape[-2]:
            causal = True  # attention()'s bottom-right is_causal is SDPA's top-left one when Nq == Nk
        else:  # SDPA keeps keys 0 .. i for query i: written out where the alignments differ
            attn_mask = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
    elif attn_mask is not None:
        kind = "bool" if attn_mask.dtype == torch.bool else "float"
        if not (kinds & ({"bool"} if kind == "bool" else {"bias", "sentinel"})):
            raise TypeError(
                f"{type(module).__qualname__}: timm passed a {kind} attn_mask to SDPA; the reviewed list "
                f"(attention/switch/timm/sdpa.py) has it passing {sorted(kinds) or 'no mask'}: review the class again"
            )
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        key = key.repeat_interleave(query.shape[-3] // key.shape[-3], dim=-3)
        value = value.repeat_interleave(query.shape[-3] // value.shape[-3], dim=-3)
    if key.shape[:-2] != query.shape[:-2]:  # SDPA broadcasts the batch axes (MobileNetV5's one k/v head): a view
        key = key.expand(*query.shape[:-2], *key.shape[-2:])
        value = value.expand(*query.shape[:-2], *value.shape[-2:])
    masks = {}
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        if "sentinel" not in kinds:  # a pure score bias (reviewed): no sentinel to find, no extra pass over it
            masks["attn_bias"] = attn_mask
        else:
            masked = attn_mask <= torch.finfo(attn_mask.dtype).min / 2  # -inf and finfo.min alike
            if "bias" in kinds:
                masks["attn_bias"] = attn_mask.masked_fill(masked, 0.0)
            masks["attn_mask"] = ~masked
    elif attn_mask is not None:
        masks["attn_mask"] = attn_mask
    temperature = query.shape[-1] ** -0.5 if scale is None else scale
    shape = query.shape
    (q, k, v), masks = _as_4d((query, key, value), masks)
    out = module._attend(q, k, v, temperature, dropout_p=dropout_p, is_causal=causal, **masks)
    return _from_4d(out, shape)


def _as_4d(tensors: tuple[Tensor, ...], masks: dict[str, Tensor]) -> tuple[tuple[Tensor, ...], dict[str, Tensor]]:
    """SDPA's ``(..., L, E)`` as ``attention()``'s ``(B, H, L, E)``: 3-D gets a head axis; 5-D ``(B, H, W, L, E)``
    (windows or blocks behind the heads: hiera, nest) becomes ``(B * W, H, L, E)``, like Swin's batch of windows."""
    dim = tensors[0].dim()
    if dim == 4:
        return tensors, masks
    if dim == 3:
        return tuple(t.unsqueeze(1) for t in tensors), {
            n: m.unsqueeze(1) if m.dim() == 3 else m for n, m in masks.items()
        }
    if dim == 5 and all(m.dim() <= 2 for m in masks.values()):
        return tuple(t.movedim(1, 2).flatten(0, 1) for t in tensors), masks
    raise ValueError(f"scaled_dot_product_attention on {dim}-D inputs with masks {list(masks)}: not supported")


def _from_4d(out: Tensor, shape: torch.Size) -> Tensor:
    if len(shape) == 3:
        return out.squeeze(1)
    if len(shape) == 5:
        return out.unflatten(0, (shape[0], shape[2])).movedim(2, 1)
    return out


def _stand_in(real: types.ModuleType, **overrides) -> types.ModuleType:
    """A module object holding ``real``'s attributes with ``overrides``: what a rebuilt forward sees as
    ``F``/``torch``."""
    module = types.ModuleType(f"{__name__}.{real.__name__}")
    module.__dict__.update({k: v for k, v in vars(real).items() if k not in ("__name__", "__spec__", "__loader__")})
    module.__dict__.update(overrides)
    return module


_FUNCTIONAL = _stand_in(nn.functional, scaled_dot_product_attention=_sdpa)
_NN = _stand_in(nn, functional=_FUNCTIONAL)
_TORCH = _stand_in(torch, nn=_NN)
_STAND_INS = {
    id(nn.functional): _FUNCTIONAL,
    id(nn): _NN,
    id(torch): _TORCH,
    id(nn.functional.scaled_dot_product_attention): _sdpa,
}


def _rebuilt(fn: types.FunctionType) -> types.FunctionType:
    """``fn`` with every global bound to torch, torch.nn, torch.nn.functional or SDPA itself replaced by its
    stand-in. The copy has no ``__name__``: torch 2.13's ``torch.compile`` takes globals that name a module for
    that module's (and guarded the real SDPA), while unnamed globals are read as they are."""
    globals_ = {name: value for name, value in fn.__globals__.items() if name != "__name__"}
    globals_.update({name: _STAND_INS[id(value)] for name, value in fn.__globals__.items() if id(value) in _STAND_INS})
    rebuilt = types.FunctionType(fn.__code__, globals_, fn.__name__, fn.__defaults__, fn.__closure__)
    rebuilt.__kwdefaults__ = fn.__kwdefaults__
    return rebuilt


def _switched_forward(timm_forward: types.FunctionType):
    rebuilt = _rebuilt(timm_forward)

    @functools.wraps(timm_forward)
    def forward(self, *args, **kwargs):
        _RUNNING.append(self)
        try:
            return rebuilt(self, *args, **kwargs)
        finally:
            _RUNNING.pop()

    return forward


def _generic_adapter(entry: Reviewed) -> type[SwitchedAttention]:
    """``Switched<module>_<Class>``: the mixin, then the timm class; timm's forward rebuilt. Kept as a global of
    this module under that name, so a switched model pickles."""
    cls = entry.cls
    name = f"Switched_{cls.__module__.rsplit('.', 1)[-1]}_{cls.__qualname__}"
    adapter = type(
        name,
        (SwitchedAttention, cls),
        {
            "forward": _switched_forward(cls.forward),
            "_sdpa_masks": entry.masks,
            "map_layout": entry.map_layout,
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": f"{entry.name} on the registry activation (generic switch). {entry.note}",
        },
    )
    globals()[name] = adapter
    return adapter


#: timm class -> its generic switched subclass.
GENERIC = {entry.cls: _generic_adapter(entry) for entry in REVIEWED}
ADAPTERS.update(GENERIC)
