"""What each attention layer attended, as maps: ``phi(S)`` per head, and where the model looks in its input.

:func:`collect_maps` runs one probe batch through a model with the ``capture`` hook set and returns, per
chosen layer, ``phi(S)`` averaged over the probe batch (and windows) and a token map on the input: the class
token's attention row reshaped to the patch grid where the layer has a class token (ViT/DeiT, XCiT's
class-attention layers), else the attention each token receives averaged over queries (Swin-style
``map_layout = "shifted_windows"``: per window, the windows put back in place with timm's ``window_reverse``
and the cyclic shift undone; a detection backbone); for token sequences (LRA) a per-token strip; none for
attention over channels (``map_layout = "channels"``). The layout is read from shapes: ``Nk`` keys are a few
prefix tokens plus a grid of the image's aspect ratio. ``figures.py`` draws them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from timm.models.swin_transformer import window_reverse
from torch import Tensor, nn

from ..attention import describe
from ..attention.switch.base import attention_map
from ..errors import ConfigError
from .probe import Layer, LayerRef, probe_attention, probing, run_probe, select_layers

#: Most prefix (class, distillation, register) tokens looked for in front of a patch grid.
MAX_PREFIX_TOKENS = 8
#: Most entries of one block of phi(S) maps made at once.
MAP_ELEMENTS = 1 << 24


@dataclass
class LayerMaps:
    """What one layer attended on the probe batch."""

    layer: Layer
    activation: str
    heat: Tensor  # (H, Nq, Nk): phi(S) averaged over the probe batch (and windows)
    tokens: Tensor | None  # (B, h, w) on an image grid or (B, N) along a sequence; None: no token map
    what: str  # what ``tokens`` shows
    channels: bool  # ``heat`` is a channel map (XCiT, DaViT, EdgeNeXt)


def _grid(n: int, height: int, width: int) -> tuple[int, int, int] | None:
    """``(prefix, h, w)`` with ``n = prefix + h * w`` and ``h : w = height : width``, fewest prefix tokens first."""
    for prefix in range(min(MAX_PREFIX_TOKENS, n - 1) + 1):
        m = n - prefix
        h = round(math.sqrt(m * height / width))
        if h > 0 and m % h == 0 and (m // h) * height == h * width:
            return prefix, h, m // h
    return None


def _swin_block(model: nn.Module, module: nn.Module) -> nn.Module:
    """The Swin block that owns ``module``: it knows the cyclic shift and the feature-map size."""
    for block in model.modules():
        if getattr(block, "attn", None) is module and hasattr(block, "shift_size"):
            return block
    raise ValueError(f"no Swin block holds {type(module).__name__}; cannot put its windows back in place")


def stitch_windows(values: Tensor, block: nn.Module) -> Tensor:
    """Per-token ``values`` ``(B * windows, wh * ww)`` of a Swin block's windows as ``(B, H, W)`` on its
    feature map: timm's ``window_reverse``, the padding cut off, the cyclic shift undone (the inverse of
    the block's ``_attn``)."""
    wh, ww = block.window_size
    rows, cols = block.input_resolution if hasattr(block, "input_resolution") else block.feat_size  # V2-CR
    hp, wp = math.ceil(rows / wh) * wh, math.ceil(cols / ww) * ww
    grid = window_reverse(values.reshape(-1, wh, ww, 1), (wh, ww), hp, wp)[:, :rows, :cols, 0]
    return torch.roll(grid, shifts=tuple(block.shift_size), dims=(1, 2))


def token_map(
    model: nn.Module, layer: Layer, first_row: Tensor, received: Tensor, queries: int, probe: Tensor
) -> tuple[Tensor | None, str]:
    """A per-sample map on the input from the head-averaged attention of query 0 (``first_row``) and the
    attention each key receives averaged over queries (``received``), both ``(B_, Nk)``; see the module doc."""
    module = layer.module
    if module.map_layout == "channels":
        return None, "channel attention: no token map"
    if probe.dim() == 2:  # token ids (B, N): a strip along the sequence
        return received, "attention received per token (mean over queries)"
    if probe.dim() != 4:
        return None, f"input of shape {tuple(probe.shape)} is neither an image batch nor a token sequence"
    batch, (height, width) = probe.shape[0], probe.shape[-2:]
    if module.map_layout == "shifted_windows":
        return stitch_windows(received, _swin_block(model, module)), "received (query mean, windows stitched)"
    keys = received.shape[-1]
    layout = _grid(keys, height, width)
    if layout is None or received.shape[0] != batch:
        return None, f"{keys} keys form no patch grid of a {height}x{width} image"
    prefix, h, w = layout
    if prefix and queries in (1, keys):
        return first_row[:, prefix:].reshape(batch, h, w), "class-token attention"
    return received[:, prefix:].reshape(batch, h, w), "received (mean over queries)"


def _rows(x: Tensor | None, rows: slice, count: int) -> Tensor | None:
    """Rows ``rows`` of a captured tensor whose first axis is the ``count`` attended rows (else it broadcasts)."""
    return x[rows] if x is not None and x.dim() == 4 and x.shape[0] == count > 1 else x


def collect_maps(
    pl_module: nn.Module, probe: Any, layers: Sequence[LayerRef] | None = None, heads: Sequence[int] | None = None
) -> list[LayerMaps]:
    """One probe forward of ``pl_module`` (no grad, eval mode, RNG untouched): :class:`LayerMaps` per layer.

    The ``phi(S)`` maps are made a few rows at a time (at most :data:`MAP_ELEMENTS` entries), so long
    sequences (LRA's 4K tokens) need no whole-batch ``B x H x N x N`` tensor.
    """
    chosen = select_layers(pl_module, layers)
    with probing(pl_module):
        records = probe_attention(chosen, lambda: run_probe(pl_module, probe))
    first = probe[0] if isinstance(probe, tuple) else probe
    result = []
    for layer in chosen:
        if not records[layer.index]:
            raise RuntimeError(f"attention layer {layer.index} ({layer.name}) did not run in the probe forward")
        inputs = records[layer.index][0]
        count, heads_total, queries, keys = (*inputs.q.shape[:3], inputs.k.shape[-2])
        picked = _heads(heads_total, heads, layer)
        step = max(1, MAP_ELEMENTS // (heads_total * queries * keys))
        heat, first_rows, received = 0.0, [], []
        for start in range(0, count, step):
            rows = slice(start, start + step)
            chunk = type(inputs)(*(_rows(x, rows, count) if isinstance(x, Tensor) else x for x in inputs))
            if inputs.key_padding_mask is not None:  # (B, Nk): always one row per attended row
                chunk = chunk._replace(key_padding_mask=inputs.key_padding_mask[rows])
            weights = attention_map(chunk, layer.module.activation_spec)[:, picked]  # (rows, heads, Nq, Nk)
            heat = heat + weights.sum(0)
            mean = weights.mean(1)
            first_rows.append(mean[:, 0])
            received.append(mean.mean(1))
        tokens, what = token_map(pl_module, layer, torch.cat(first_rows), torch.cat(received), queries, first)
        result.append(
            LayerMaps(
                layer,
                describe(layer.module.activation),
                heat / count,
                tokens,
                what,
                layer.module.map_layout == "channels",
            )
        )
    return result


def _heads(count: int, heads: Sequence[int] | None, layer: Layer) -> list[int]:
    if heads is None:
        return list(range(count))
    bad = [h for h in heads if not 0 <= h < count]
    if bad:
        raise ConfigError(f"layer {layer.index} ({layer.name}) has heads 0..{count - 1}; got {bad}")
    return list(heads)
