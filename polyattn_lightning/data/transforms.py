"""Image transforms: timm's ``create_transform`` with the DeiT augmentation recipe."""

from __future__ import annotations

from dataclasses import dataclass

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, create_transform

from ..checkpoint import checkpoint_safe


@checkpoint_safe
@dataclass
class AugmentRecipe:
    """Training augmentation; the defaults are DeiT's (timm argument names).

    Evaluation always resizes to ``img_size / crop_pct`` and centre-crops.
    """

    auto_augment: str | None = "rand-m9-mstd0.5-inc1"
    re_prob: float = 0.25
    re_mode: str = "pixel"
    color_jitter: float = 0.3  # unused by timm while auto_augment is set, as in DeiT
    interpolation: str = "bicubic"
    scale: tuple[float, float] = (0.08, 1.0)
    hflip: float = 0.5
    crop_pct: float = 0.875
    mean: tuple[float, float, float] = IMAGENET_DEFAULT_MEAN
    std: tuple[float, float, float] = IMAGENET_DEFAULT_STD


def build_transform(img_size: int, train: bool, recipe: AugmentRecipe):
    """The torchvision transform for one split."""
    common = dict(input_size=img_size, interpolation=recipe.interpolation, mean=recipe.mean, std=recipe.std)
    if not train:
        return create_transform(**common, is_training=False, crop_pct=recipe.crop_pct)
    return create_transform(
        **common,
        is_training=True,
        auto_augment=recipe.auto_augment,
        re_prob=recipe.re_prob,
        re_mode=recipe.re_mode,
        color_jitter=recipe.color_jitter,
        scale=recipe.scale,
        hflip=recipe.hflip,
    )
