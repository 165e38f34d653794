"""The reference for switched timm models: timm's own forward, with every SDPA call computed as ``phi(S) @ v``.

:class:`MaterializedSDPA` is a ``TorchFunctionMode``: under it, an unswitched timm model (with
``fused_attn`` on, so each attention reaches SDPA) runs exactly timm's code, and each
``scaled_dot_product_attention`` call becomes the whole score matrix through the formulas of
``attention_reference``. SDPA's masks mean what the project promises: a bool mask is True =
attend; a float mask adds its finite entries to the scores and drops keys at ``-inf``/``finfo.min``;
``is_causal`` keeps the lower triangle; ``N`` counts the keys a row keeps. No family's forward is copied.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from attention_reference import reference_attention


class MaterializedSDPA(TorchFunctionMode):
    def __init__(self, activation: str):
        super().__init__()
        self.activation = activation
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") != "scaled_dot_product_attention":
            return func(*args, **kwargs)
        self.calls += 1
        return self.sdpa(*args, **kwargs)

    def sdpa(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        assert dropout_p == 0.0, "the reference runs in eval mode"
        q64, k64, v64 = q.double(), k.double(), v.double()
        if enable_gqa:
            k64 = k64.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            v64 = v64.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        q64 = q64 * (scale * q.shape[-1] ** 0.5)  # reference_attention divides by sqrt(d)
        keep = bias = None
        if is_causal:
            keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        elif attn_mask is not None and attn_mask.dtype == torch.bool:
            keep = attn_mask
        elif attn_mask is not None:
            keep = attn_mask > -1e30
            bias = torch.where(keep, attn_mask.double(), 0.0)
        shape = torch.broadcast_shapes(q64.shape[:-1] + (k64.shape[-2],), *(() if keep is None else (keep.shape,)))
        keep = torch.ones(shape, dtype=torch.bool) if keep is None else keep.expand(shape)
        k64 = k64.expand(*q64.shape[:-2], *k64.shape[-2:])
        v64 = v64.expand(*q64.shape[:-2], *v64.shape[-2:])
        return reference_attention(q64, k64, v64, self.activation, keep=keep, bias=bias).to(q.dtype)


def reference_forward(model: nn.Module, x: torch.Tensor, activation: str) -> torch.Tensor:
    """timm's forward of the unswitched ``model`` (``fused_attn`` forced on), SDPA materialized with ``activation``."""
    for module in model.modules():
        if hasattr(module, "fused_attn"):
            module.fused_attn = True
    mode = MaterializedSDPA(activation)
    with torch.no_grad(), mode:
        out = model(x)
    assert mode.calls > 0, "the model made no SDPA call"
    return out
