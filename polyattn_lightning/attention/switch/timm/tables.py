"""What the timm switch leaves softmax, and why: the refusal tables and the verdicts read from them.

Each table names timm classes by decision, after reading their code (timm 1.0.31): attention that is not
softmax over dot products of tokens (never switched), attention pooling heads (softmax by decision, named in a
log line, never a refusal), and hand-computed softmax that has no adapter yet (refused by class, so also where
no probe forward runs).
"""

from __future__ import annotations

from dataclasses import dataclass

import timm.layers.attention2d as attention2d
import timm.layers.attention_pool as attention_pool
import timm.layers.attention_pool2d as attention_pool2d
import timm.layers.global_context as global_context
import timm.layers.lambda_layer as lambda_layer
import timm.layers.non_local_attn as non_local_attn
import timm.layers.other_pool as other_pool
import timm.layers.selective_kernel as selective_kernel
import timm.layers.split_attn as split_attn
import timm.models.coat as coat
import timm.models.efficientvim as efficientvim
import timm.models.efficientvit_mit as efficientvit_mit
import timm.models.mobilevit as mobilevit
import timm.models.mvitv2 as mvitv2
import timm.models.swiftformer as swiftformer
import timm.models.volo as volo
from torch import nn

from ..base import SwitchedAttention
from .probe import SoftmaxCall

#: Softmax that is not attention over tokens (dot products of queries and keys): never switched.
NOT_TOKEN_ATTENTION: dict[type[nn.Module], str] = {
    split_attn.SplitAttn: "split attention (softmax over the radix groups of channels), not attention over tokens",
    selective_kernel.SelectiveKernelAttn: (
        "selective-kernel attention (softmax over kernel branches), not attention over tokens"
    ),
    swiftformer.EfficientAdditiveAttention: "additive attention (one learned global query), not dot-product attention",
    coat.FactorAttnConvRelPosEnc: "factorised attention (softmax over keys, then k^T v), not a dot-product map",
    volo.OutlookAttention: (
        "outlook attention (weights made by a linear layer, no q k^T); VOLO's class attention is another class"
    ),
    efficientvit_mit.LiteMLA: "LiteMLA is already linear (ReLU) attention; it has no softmax to switch",
    mobilevit.LinearSelfAttention: (
        "MobileViTv2's separable linear attention (softmax over one context vector), not q k^T"
    ),
    lambda_layer.LambdaLayer: "lambda layer (softmax over keys, then k^T v), not a dot-product map",
    global_context.GlobalContext: "global-context pooling (softmax over positions of one learned score)",
    efficientvim.HSMSSD: "hidden-state mixer of a state-space model, not attention",
    efficientvim.EfficientViM: "the head's softmax over learned fusion weights, not attention",
}

#: Attention pooling heads: they stay softmax by decision (named in the log line, never a refusal).
POOLING_HEADS: tuple[type[nn.Module], ...] = (
    attention_pool.AttentionPoolLatent,
    attention_pool.AttentionPoolPrr,
    attention_pool2d.AttentionPool2d,
    attention_pool2d.RotAttentionPool2d,
    other_pool.SimPool1d,
    other_pool.SimPool2d,
)

#: timm classes that compute softmax attention by hand and have no adapter in ``families/`` (its package
#: docstring says why): refused by class, so also where no probe forward runs. A class that gets an adapter
#: leaves this list (``tests/attention/switch/test_timm_refusals.py`` checks that none is on both).
HAND_SOFTMAX: tuple[type[nn.Module], ...] = (
    mvitv2.MultiScaleAttentionPoolFirst,
    non_local_attn.NonLocalAttn,
    attention2d.MultiQueryAttentionV2,
)


def class_name(cls: type) -> str:
    """``timm.models.beit.Attention``: the class with its module, as refusals name it."""
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass(frozen=True)
class Unswitched:
    """A module that keeps softmax: where, what, why, and whether that is by decision (a pooling head)."""

    path: str
    cls: type[nn.Module]
    reason: str
    by_decision: bool = False

    def __str__(self) -> str:
        return f"{self.path or '<model>'} ({class_name(self.cls)}): {self.reason}"


def static_verdict(module: nn.Module) -> tuple[str, bool] | None:
    """Why ``module`` keeps softmax, read from its class alone (None: nothing known against it)."""
    cls = type(module)
    if cls in NOT_TOKEN_ATTENTION:
        return NOT_TOKEN_ATTENTION[cls], False
    if isinstance(module, POOLING_HEADS):
        return "attention pooling head: stays softmax by decision", True
    if cls in HAND_SOFTMAX:
        return "computes softmax by hand; no adapter in attention/switch/timm/families yet", False
    if hasattr(module, "fused_attn"):
        return (
            "runs softmax attention (timm's fused_attn flag) but is not on the reviewed list "
            "(switch/timm/sdpa.py's REVIEWED)",
            False,
        )
    return None


def probe_verdict(call: SoftmaxCall) -> Unswitched:
    """The innermost module of a leftover softmax call that a table explains, else the module that made it."""
    for path, module in reversed(call.stack):
        verdict = static_verdict(module)
        if verdict is not None and not isinstance(module, SwitchedAttention):
            return Unswitched(path, type(module), *verdict)
    path, module = call.stack[-1] if call.stack else ("", None)
    where = "calls SDPA" if call.function == "scaled_dot_product_attention" else f"calls {call.function}"
    if isinstance(module, SwitchedAttention) and getattr(module, "keeps_softmax", None):
        return Unswitched(path, type(module), module.keeps_softmax, by_decision=True)  # e.g. ConViT's GPSA
    if isinstance(module, SwitchedAttention):
        reason = f"is switched but still {where} in the probe forward (an adapter misses a step)"
    else:
        reason = f"{where} in the probe forward and has no switch"
    return Unswitched(path, type(module) if module is not None else nn.Module, reason)
