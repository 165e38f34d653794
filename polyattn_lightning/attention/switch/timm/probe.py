"""The timm probe: the image a model was built for, and the softmax calls of a forward on it.

:func:`image_probe` makes one random image at the size the model was built for (:func:`built_size`);
the recorder that says which modules still compute softmax is shared with the Hugging Face switch
(:mod:`~polyattn_lightning.attention.switch.recorder`, re-exported here).
"""

from __future__ import annotations

from collections.abc import Callable

import timm.models.efficientformer_v2 as efficientformer_v2
import timm.models.gcvit as gcvit
import timm.models.hiera as hiera
import timm.models.levit as levit
import timm.models.mvitv2 as mvitv2
import torch
from torch import nn

from ..recorder import RECORDED, SoftmaxCall, softmax_calls


def image_probe(model: nn.Module, img_size: int | tuple[int, int] | None = None) -> Callable[[], object] | None:
    """A no-grad forward of one random image at ``img_size`` or the model's own input size, or None when it
    has none.

    The size is ``img_size``, else the one the model was built for (:func:`built_size`), else timm's
    ``pretrained_cfg['input_size']``; the image comes from a private generator, so the global RNG is untouched.
    """
    cfg = getattr(model, "pretrained_cfg", None) or {}
    channels, *size = cfg.get("input_size", (3, None, None))
    given = img_size if img_size is not None else built_size(model)
    if given is not None:
        size = [given, given] if isinstance(given, int) else list(given)
    if None in size or not size:
        return None
    parameter = next(model.parameters(), None)
    device = parameter.device if parameter is not None else None
    dtype = parameter.dtype if parameter is not None and parameter.is_floating_point() else torch.float32
    image = torch.randn(1, channels, *size, generator=torch.Generator().manual_seed(0)).to(device, dtype)

    def run():
        with torch.no_grad():
            return model(image)

    return run


def built_size(model: nn.Module) -> int | tuple[int, ...] | None:
    """The image size ``model`` was built for, or None where it keeps none.

    The ``img_size`` of its patch embedding (a ViT-like model's), of the model, or of TNT's pixel embedding;
    else, for the models that keep it only as a token grid (the one their attention biases, windows or
    position embeddings were sized for), that grid times its stride from the image (:data:`GRID_SIZED`):
    an image of that size gives the same grid through timm's floor and ceiling divisions.
    """
    for owner in (getattr(model, "patch_embed", None), model, getattr(model, "pixel_embed", None)):
        size = getattr(owner, "img_size", None)
        if size is not None:
            return size
    for cls, grid_size in GRID_SIZED.items():
        if isinstance(model, cls):
            return grid_size(model)
    return None


def _times(grid, stride) -> tuple[int, ...]:
    strides = stride if isinstance(stride, (tuple, list)) else [stride] * len(grid)
    return tuple(side * step for side, step in zip(grid, strides))


def _levit_size(model: levit.Levit) -> tuple[int, ...] | None:
    """The first stage's attention grid (no downsampling before it) times the stem's stride."""
    grid = next((m.resolution for m in model.modules() if isinstance(m, levit.Attention)), None)
    return None if grid is None else _times(grid, model.feature_info[0]["reduction"])


def _efficientformer_v2_size(model: efficientformer_v2.EfficientFormerV2) -> tuple[int, ...] | None:
    """The grid of the attention downsampling (its stage's input) times the stride of the stage before it."""
    for path, module in model.named_modules():
        if isinstance(module, efficientformer_v2.Attention2dDownsample):  # stages.<i>.downsample.attn
            return _times(module.resolution, model.feature_info[int(path.split(".")[1]) - 1]["reduction"])
    return None


def _first_stage_size(model: nn.Module) -> tuple[int, ...]:
    """The first stage's feature grid (``feat_size``) times its stride (``feature_info``): GCViT, MViTv2."""
    return _times(model.stages[0].feat_size, model.feature_info[0]["reduction"])


#: Models whose built size is only in a token grid: class -> the size, or None.
GRID_SIZED: dict[type[nn.Module], Callable[[nn.Module], tuple[int, ...] | None]] = {
    levit.Levit: _levit_size,
    efficientformer_v2.EfficientFormerV2: _efficientformer_v2_size,
    gcvit.GlobalContextVit: _first_stage_size,
    mvitv2.MultiScaleVit: _first_stage_size,
    hiera.Hiera: lambda model: _times(model.tokens_spatial_shape, model.patch_stride),
}


__all__ = ["GRID_SIZED", "RECORDED", "SoftmaxCall", "built_size", "image_probe", "softmax_calls"]
