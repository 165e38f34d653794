"""The attention maps drawn with matplotlib: heat maps per layer and head, and overlays on the input."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from matplotlib.figure import Figure  # pyplot-free: no GUI backend, nothing kept alive after saving
from torch import Tensor, nn

from .maps import LayerMaps, collect_maps
from .probe import LayerRef


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
        for ax in row[m.heat.shape[0] :]:
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
            heat = ax.imshow(
                tokens.numpy(), alpha=0.6, extent=(0, width, height, 0), interpolation="nearest", **_colours(tokens)
            )
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
