"""Pictures of phi(S): heat maps per layer and head, and where the model looks in its input.

:func:`attention_pictures` runs one probe batch through a model with the
``capture`` hook set (see :mod:`~polyattn_lightning.attention.timm_patch` for the
contract) and draws two matplotlib figures:

* heat maps of ``phi(S)`` averaged over the probe batch (and Swin's windows), one
  panel per chosen layer and head with its colour bar; for channel attention (XCiT's cross-covariance
  attention, DaViT's and EdgeNeXt's) the ``d x d`` channel map;
* an overlay per layer and probe sample, the heads' average: the class token's
  attention row reshaped to the patch grid where the layer has a class token
  (ViT/DeiT, XCiT's class-attention layers), else the attention each token
  receives averaged over queries (Swin V1/V2/V2-CR: per window, the windows put back in
  place with timm's ``window_reverse`` and the cyclic shift undone; a detection
  backbone), drawn over the image; for token sequences (LRA) a per-token strip.

The layout is read from shapes: ``Nk`` keys are a few prefix tokens plus a grid
of the image's aspect ratio. :class:`AttentionMaps` draws them at the end of
validation; ``polyattn maps`` from a checkpoint and an image file.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import move_data_to_device
from matplotlib.figure import Figure  # pyplot-free: no GUI backend, nothing kept alive after saving
from timm.models.swin_transformer import window_reverse
from torch import Tensor, nn

from ..attention import describe
from ..attention.diagnostics import Layer, LayerRef, probe_attention, select_layers
from ..attention.timm_adapters.channel_attention import (
    DaViTChannelAttention,
    DaViTChannelAttentionV2,
    EdgeNeXtChannelAttention,
)
from ..attention.timm_adapters.swin_v2 import SwinV2CrWindowAttention, SwinV2WindowAttention
from ..attention.timm_patch import SwinWindowAttention, XCiTAttention, attention_map
from .attention_norms import probe_batch, probing, run_probe
from ..errors import ConfigError

#: Most prefix (class, distillation, register) tokens looked for in front of a patch grid.
MAX_PREFIX_TOKENS = 8
#: Most entries of one block of phi(S) maps made at once.
MAP_ELEMENTS = 1 << 24
#: Switched classes whose map is over channels (``d x d`` per head): no token map.
CHANNEL_ATTENTION = (XCiTAttention, DaViTChannelAttention, DaViTChannelAttentionV2, EdgeNeXtChannelAttention)
#: Swin-style shifted-window attention: rows are ``B * windows``; the block knows the shift and the grid.
SHIFTED_WINDOW_ATTENTION = (SwinWindowAttention, SwinV2WindowAttention, SwinV2CrWindowAttention)


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
    if isinstance(module, CHANNEL_ATTENTION):
        return None, "channel attention: no token map"
    if probe.dim() == 2:  # token ids (B, N): a strip along the sequence
        return received, "attention received per token (mean over queries)"
    if probe.dim() != 4:
        return None, f"input of shape {tuple(probe.shape)} is neither an image batch nor a token sequence"
    batch, (height, width) = probe.shape[0], probe.shape[-2:]
    if isinstance(module, SHIFTED_WINDOW_ATTENTION):
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
            LayerMaps(layer, describe(layer.module.activation), heat / count, tokens, what,
                      isinstance(layer.module, CHANNEL_ATTENTION))
        )
    return result


def _heads(count: int, heads: Sequence[int] | None, layer: Layer) -> list[int]:
    if heads is None:
        return list(range(count))
    bad = [h for h in heads if not 0 <= h < count]
    if bad:
        raise ConfigError(f"layer {layer.index} ({layer.name}) has heads 0..{count - 1}; got {bad}")
    return list(heads)


def _colours(values: Tensor) -> dict[str, Any]:
    """``imshow`` colour arguments: a diverging map centred on 0 when ``values`` change sign (x^3 does)."""
    low, high = float(values.min()), float(values.max())
    if low < 0 < high:
        bound = max(-low, high)
        return dict(cmap="RdBu_r", vmin=-bound, vmax=bound)
    return dict(cmap="viridis")


def heatmap_figure(maps: Sequence[LayerMaps], heads: Sequence[int] | None, title: str) -> Figure:
    """One row per layer, one panel per head: ``phi(S)`` with a colour bar."""
    columns = max(m.heat.shape[0] for m in maps)
    fig = Figure(figsize=(max(3.0 * columns, 7.0), 2.8 * len(maps) + 0.6), layout="constrained")
    axes = fig.subplots(len(maps), columns, squeeze=False)
    for row, m in zip(axes, maps):
        labels = heads if heads is not None else range(m.heat.shape[0])
        for ax, head, heat in zip(row, labels, m.heat):
            heat = heat.cpu()
            image = ax.imshow(heat.numpy(), interpolation="nearest", **_colours(heat))
            fig.colorbar(image, ax=ax, shrink=0.85).ax.tick_params(labelsize=7)
            ax.set_title(f"layer {m.layer.index}, head {head}\n{m.layer.name}", fontsize=8)
            axis = "channel" if m.channels else "token"
            ax.set_xlabel(f"key {axis}", fontsize=8)
            ax.set_ylabel(f"query {axis}", fontsize=8)
            ax.tick_params(labelsize=7)
        for ax in row[m.heat.shape[0]:]:
            ax.axis("off")
    fig.suptitle(title, fontsize=10)
    return fig


def _display(image: Tensor) -> Tensor:
    """A ``(C, H, W)`` normalised image as ``(H, W, C)`` (or ``(H, W)``) in [0, 1] for ``imshow``."""
    image = image.detach().float().cpu()
    image = (image - image.min()) / (image.max() - image.min()).clamp(min=1e-12)
    return image[0] if image.shape[0] == 1 else image.permute(1, 2, 0)


def overlay_figure(maps: Sequence[LayerMaps], probe: Any, samples: int, title: str) -> Figure | None:
    """Token maps of the layers that have one, over the first ``samples`` probe images (or as strips); None if none."""
    maps = [m for m in maps if m.tokens is not None]
    if not maps:
        return None
    first = probe[0] if isinstance(probe, tuple) else probe
    if maps[0].tokens.dim() == 2:  # sequences: one strip per layer, a row per sample
        fig = Figure(figsize=(10, 1.2 + (0.35 * samples + 0.8) * len(maps)), layout="constrained")
        axes = fig.subplots(len(maps), 1, squeeze=False)
        for ax, m in zip(axes[:, 0], maps):
            strip = m.tokens[:samples].cpu()
            image = ax.imshow(strip.numpy(), aspect="auto", interpolation="nearest", **_colours(strip))
            fig.colorbar(image, ax=ax, label="weight")
            ax.set_title(f"layer {m.layer.index} ({m.layer.name}): {m.what}", fontsize=9)
            ax.set_xlabel("token position")
            ax.set_ylabel("probe sample")
        fig.suptitle(title, fontsize=10)
        return fig
    samples = min(samples, first.shape[0])
    fig = Figure(figsize=(max(3.3 * samples, 7.0), 3.0 * len(maps) + 0.6), layout="constrained")
    axes = fig.subplots(len(maps), samples, squeeze=False)
    height, width = first.shape[-2:]
    for row, m in zip(axes, maps):
        for i, ax in enumerate(row):
            ax.imshow(_display(first[i]), cmap="gray", extent=(0, width, height, 0))
            tokens = m.tokens[i].cpu()
            heat = ax.imshow(tokens.numpy(), alpha=0.6, extent=(0, width, height, 0), interpolation="nearest",
                             **_colours(tokens))
            bar = fig.colorbar(heat, ax=ax, shrink=0.85)
            bar.solids.set_alpha(1.0)
            bar.ax.tick_params(labelsize=7)
            ax.set_title(f"layer {m.layer.index}, sample {i}\n{m.what}", fontsize=8)
            ax.set_xlabel("x (pixels)", fontsize=8)
            ax.set_ylabel("y (pixels)", fontsize=8)
            ax.tick_params(labelsize=7)
    fig.suptitle(title, fontsize=10)
    return fig


def attention_pictures(
    pl_module: nn.Module,
    probe: Any,
    layers: Sequence[LayerRef] | None = None,
    heads: Sequence[int] | None = None,
    samples: int = 4,
    caption: str = "",
) -> dict[str, Figure]:
    """``{"heatmaps": fig, "overlay": fig}`` (no overlay where no layer has a token map)."""
    maps = collect_maps(pl_module, probe, layers, heads)
    first = probe[0] if isinstance(probe, tuple) else probe
    activations = ", ".join(sorted({m.activation for m in maps}))
    heat_title = f"phi(S) per layer and head, {activations}\nmean over {first.shape[0]} probe samples{caption}"
    figures = {"heatmaps": heatmap_figure(maps, heads, heat_title)}
    overlay = overlay_figure(maps, probe, samples, f"Where the model looks, {activations}\nmean over heads{caption}")
    if overlay is not None:
        figures["overlay"] = overlay
    return figures


class AttentionMaps(Callback):
    """At the end of validation, draw :func:`attention_pictures` on a fixed probe batch.

    The probe is the first ``probe_size`` samples of the first validation batch,
    taken once. PNGs go to ``<log dir>/attention_maps/step{global step}_{heatmaps,overlay}.png``
    and to TensorBoard (``add_figure``) when the run logs there; with other loggers
    the files are the record. Only global rank zero draws and writes; no rank waits.
    """

    def __init__(
        self,
        layers: Sequence[LayerRef] | None = None,
        heads: Sequence[int] | None = None,
        probe_size: int = 8,
        samples: int = 4,
        every_n_epochs: int = 1,
    ):
        """
        Args:
            layers: 1-based attention layer numbers or module names; None: every layer.
            heads: head indices (0-based) to draw; None: every head.
            probe_size: samples in the probe batch (the heat maps average over them).
            samples: probe samples shown in the overlay.
            every_n_epochs: draw after every n-th validation.
        """
        self.layers = None if layers is None else list(layers)
        self.heads = None if heads is None else list(heads)
        self.probe_size, self.samples, self.every_n_epochs = probe_size, samples, every_n_epochs
        self._probe: Any = None
        self._dir: Path | None = None
        self._validations = 0

    def state_dict(self) -> dict[str, Any]:
        """The probe, so that a resumed run draws the same samples."""
        return {"probe": move_data_to_device(self._probe, "cpu"), "validations": self._validations}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._probe, self._validations = state_dict.get("probe"), state_dict.get("validations", 0)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._dir = Path(trainer.log_dir or trainer.default_root_dir) / "attention_maps"  # log_dir: every rank

    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self._probe is None and trainer.is_global_zero and not trainer.sanity_checking:
            self._probe = probe_batch(pl_module, batch, self.probe_size)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero or self._probe is None:
            return
        self._validations += 1
        if (self._validations - 1) % self.every_n_epochs:
            return
        step = trainer.global_step
        figures = attention_pictures(pl_module, self._probe, self.layers, self.heads, self.samples,
                                     f" (epoch {trainer.current_epoch}, step {step})")
        self._dir.mkdir(parents=True, exist_ok=True)
        for name, fig in figures.items():
            fig.savefig(self._dir / f"step{step:07d}_{name}.png", dpi=100)
            for logger in trainer.loggers:
                if isinstance(logger, TensorBoardLogger):
                    logger.experiment.add_figure(f"attention_maps/{name}", fig, global_step=step, close=False)
