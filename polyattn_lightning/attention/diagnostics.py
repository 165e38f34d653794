"""Norm diagnostics of the attention map, for the callbacks that log them.

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

:func:`probe_attention` runs a model once with the ``capture`` hook of its
switched attention modules set (see :mod:`~polyattn_lightning.attention.timm_patch`)
and returns what each chosen layer attended; :func:`captured_norms` reduces one
layer's capture to the three per-head norms the callbacks log.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor, nn

from .functional import attention, resolve_scores
from .masks import keys_per_row, with_causal
from .registry import ActivationSpec, autocast_off
from ..errors import ConfigError

if TYPE_CHECKING:
    from .timm_patch import AttentionInputs, SwitchedAttention

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


#: A layer to watch: its 1-based position among the model's attention modules, or its module name.
LayerRef = int | str


class Layer(NamedTuple):
    """One attention layer of a model: 1-based ``index`` in forward order, module ``name``, the module."""

    index: int
    name: str
    module: "SwitchedAttention"


def select_layers(model: nn.Module, layers: Sequence[LayerRef] | None = None) -> list[Layer]:
    """The attention layers ``layers`` names (1-based numbers or module names; None: all), in model order.

    A layer is a module with the ``capture`` hook (:class:`SwitchedAttention`), numbered
    in ``named_modules`` order, which is forward order for timm models and the LRA encoder.
    """
    from .timm_patch import attention_modules  # timm only when diagnostics run

    found = [Layer(i, name, module) for i, (name, module) in enumerate(attention_modules(model), 1)]
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no attention module with the capture hook (a SwitchedAttention); "
            "switch a timm model with set_attention or build it from SwitchedAttention modules"
        )
    if layers is None:
        return found
    by_name = {layer.name: layer for layer in found}
    chosen = []
    for ref in layers:
        if isinstance(ref, int) and 1 <= ref <= len(found):
            chosen.append(found[ref - 1])
        elif isinstance(ref, str) and ref in by_name:
            chosen.append(by_name[ref])
        else:
            raise ConfigError(
                f"no attention layer {ref!r}: expected a number 1..{len(found)} or one of the module names "
                f"{', '.join(by_name)}"
            )
    return sorted(set(chosen), key=lambda layer: layer.index)


def probe_attention(layers: Sequence[Layer], run: Callable[[], object]) -> dict[int, list["AttentionInputs"]]:
    """Call ``run()`` (a forward of the model ``layers`` are in) with ``capture`` set on ``layers``; returns each layer's
    captured inputs by layer index, detached, one entry per call of that layer (two-tower models call twice).

    The hooks that were set before are put back, also when ``run`` raises.
    """
    records: dict[int, list] = {layer.index: [] for layer in layers}
    saved = [layer.module.capture for layer in layers]

    def keep(index: int) -> Callable:
        def hook(module: nn.Module, inputs: "AttentionInputs") -> None:
            records[index].append(type(inputs)(*(x.detach() if isinstance(x, Tensor) else x for x in inputs)))

        return hook

    try:
        for layer in layers:
            layer.module.capture = keep(layer.index)
        run()
    finally:
        for layer, hook in zip(layers, saved):
            layer.module.capture = hook
    return records


class CapturedNorms(NamedTuple):
    """Per-head norms of one captured attention call, each ``(H,)``, averaged over the batch."""

    phi: Tensor
    jacobian: Tensor
    output: Tensor


@torch.no_grad()
def captured_norms(inputs: "AttentionInputs", activation: ActivationSpec) -> CapturedNorms:
    """``||phi(S)||_F``, ``||d phi(S)/dS||_F`` and ``||phi(S) v||_F`` per head for what a layer attended."""
    masks = dict(attn_mask=inputs.attn_mask, attn_bias=inputs.attn_bias, key_padding_mask=inputs.key_padding_mask)
    norms = attention_norms(inputs.q, inputs.k, activation, temperature=inputs.temperature, **masks)
    out = attention(inputs.q, inputs.k, inputs.v, activation, temperature=inputs.temperature, **masks)
    output = out.float().square().sum((-2, -1)).sqrt().mean(0)
    return CapturedNorms(norms.phi, norms.jacobian, output)
