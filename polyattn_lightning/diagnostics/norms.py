"""Norm diagnostics of the attention map: what the norm callback logs and ``polyattn norms`` draws.

The polynomial-attention paper's argument: softmax works because it keeps
``||softmax(S)||_F <= sqrt(N)`` and its Jacobian's Frobenius norm bounded;
an activation scaled by ``1/sqrt(N)`` keeps both at ``O(sqrt(N))``. This module
measures the two norms per head:

* ``||phi(S)||_F`` over the ``Nq x Nk`` map;
* the Frobenius norm of ``d phi(S) / d S``. For an elementwise ``phi`` the
  Jacobian is diagonal, so this is ``||phi'(S)||_F``. For softmax each row has
  ``J = diag(p) - p p^T`` and ``||J||_F^2 = sum p^2 - 2 sum p^3 + (sum p^2)^2``;
  rows add.

Both are computed over blocks of query rows (never the whole ``N x N``), with
masked pairs contributing nothing, and averaged over the batch.

:func:`captured_norms` reduces what one layer attended (captured by
:func:`~polyattn_lightning.diagnostics.probe.probe_attention`) to three per-head norms, and
:func:`measure_norms` runs one probe forward and returns them by metric key.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from ..attention.dtypes import autocast_off
from ..attention.functional import attention, resolve_scores
from ..attention.masks import keys_per_row, with_causal
from ..attention.registry import ActivationSpec
from ..attention.switch.base import AttentionInputs
from .probe import LayerRef, probe_attention, probing, run_probe, select_layers

#: Logged quantities, by the field of :class:`CapturedNorms`.
QUANTITIES = {"phi": "phi_norm", "jacobian": "jacobian_norm", "output": "output_norm"}

#: Elements of one ``(B, H, rows, Nk)`` score block.
BLOCK_ELEMENTS = 1 << 22


class NormValues(NamedTuple):
    """Per-head norms, each ``(H,)``, averaged over the batch."""

    phi: Tensor
    jacobian: Tensor


@torch.no_grad()
def attention_norms(
    q: Tensor,
    k: Tensor,
    activation: ActivationSpec = "softmax",
    *,
    scale: float | str | None = None,
    temperature: float | None = None,
    key_padding_mask: Tensor | None = None,
    attn_mask: Tensor | None = None,
    attn_bias: Tensor | None = None,
    is_causal: bool = False,
) -> NormValues:
    """``||phi(S)||_F`` and ``||d phi(S)/dS||_F`` per head, for the scores ``attention()`` would use."""
    act, t, masks = resolve_scores(
        q, k, activation, scale, temperature, key_padding_mask, attn_mask, attn_bias, is_causal=is_causal
    )
    n = keys_per_row(masks.allowed, k.shape[-2], q.device, masks.causal)
    allowed = with_causal(masks.allowed, masks.causal, q.shape[-2], k.shape[-2], q.device)
    B, H, nq, _ = q.shape
    rows = max(1, BLOCK_ELEMENTS // (B * H * k.shape[-2]))
    phi_sq = torch.zeros(B, H, dtype=torch.float64, device=q.device)
    jac_sq = torch.zeros_like(phi_sq)
    with autocast_off(q.device.type):
        q, k = q.float() * t, k.float()
        for start in range(0, nq, rows):
            block = slice(start, start + rows)
            s = q[:, :, block] @ k.transpose(-2, -1)
            for extra in (masks.additive, attn_bias):
                if extra is not None:
                    s = s + _rows(extra, block).float()
            keep = None if allowed is None else _rows(allowed, block)
            if act.is_softmax:
                p = _softmax(s, keep)
                p2 = p.square().sum(-1)
                phi_sq += p2.sum(-1)
                jac_sq += (p2 - 2 * p.pow(3).sum(-1) + p2.square()).sum(-1)
            else:
                counts = _rows(n, block)
                phi, grad = act(s, counts), act.derivative(s, counts)
                if keep is not None:
                    phi, grad = phi.masked_fill(~keep, 0.0), grad.masked_fill(~keep, 0.0)
                phi_sq += phi.square().sum((-2, -1))
                jac_sq += grad.square().sum((-2, -1))
    return NormValues(phi_sq.sqrt().mean(0).float(), jac_sq.sqrt().mean(0).float())


def _rows(x: Tensor, block: slice) -> Tensor:
    """Query rows ``block`` of a tensor broadcastable along them (size-1 or absent row dims are kept)."""
    return x if x.dim() < 2 or x.shape[-2] == 1 else x[..., block, :]


def _softmax(s: Tensor, keep: Tensor | None) -> Tensor:
    """Softmax over keys; a row with no allowed key is all zeros."""
    if keep is None:
        return s.softmax(-1)
    return s.masked_fill(~keep, float("-inf")).softmax(-1).nan_to_num(0.0)


class CapturedNorms(NamedTuple):
    """Per-head norms of one captured attention call, each ``(H,)``, averaged over the batch."""

    phi: Tensor
    jacobian: Tensor
    output: Tensor


@torch.no_grad()
def captured_norms(inputs: AttentionInputs, activation: ActivationSpec) -> CapturedNorms:
    """``||phi(S)||_F``, ``||d phi(S)/dS||_F`` and ``||phi(S) v||_F`` per head for what a layer attended."""
    masks = dict(attn_mask=inputs.attn_mask, attn_bias=inputs.attn_bias, key_padding_mask=inputs.key_padding_mask)
    norms = attention_norms(inputs.q, inputs.k, activation, temperature=inputs.temperature, **masks)
    out = attention(inputs.q, inputs.k, inputs.v, activation, temperature=inputs.temperature, **masks)
    output = out.float().square().sum((-2, -1)).sqrt().mean(0)
    return CapturedNorms(norms.phi, norms.jacobian, output)


def metric_key(quantity: str, layer: int, head: int | None) -> str:
    """``attention/phi_norm/layer02/head0`` (``.../mean`` for the average over heads)."""
    return f"attention/{quantity}/layer{layer:02d}/{'mean' if head is None else f'head{head}'}"


def measure_norms(model: nn.Module, probe: Any, layers: Sequence[LayerRef] | None = None) -> dict[str, float]:
    """One probe forward of ``model`` (no grad, eval mode, RNG untouched): the norms of ``layers`` (None: all) per
    head and averaged over heads, by :func:`metric_key` (a layer called twice is averaged over its calls)."""
    chosen = select_layers(model, layers)
    with probing(model):
        records = probe_attention(chosen, lambda: run_probe(model, probe))
        metrics = {}
        for layer in chosen:
            if not records[layer.index]:
                raise RuntimeError(f"attention layer {layer.index} ({layer.name}) did not run in the probe forward")
            calls = [captured_norms(inputs, layer.module.activation) for inputs in records[layer.index]]
            for field, quantity in QUANTITIES.items():
                per_head = torch.stack([getattr(norms, field) for norms in calls]).mean(0).tolist()
                for head, value in enumerate(per_head):
                    metrics[metric_key(quantity, layer.index, head)] = value
                metrics[metric_key(quantity, layer.index, None)] = sum(per_head) / len(per_head)
    return metrics
