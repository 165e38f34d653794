"""Image transforms: timm's ``create_transform`` with an augmentation recipe, DeiT's or a light one chosen by the data.

DeiT's ImageNet policy (RandAugment m9, random erasing 0.25, random-resized crops down to 8% of the image) is a
regulariser for a model that sees a million large images many times over. On a few hundred small images it destroys
more than it teaches: at 16-32 px one RandAugment shear or erased patch removes most of the object, and a short run on
little data underfits before it can overfit, so the regulariser only keeps the model at chance. :func:`recipe_for`
therefore gives DeiT's policy only to large data sets of large images and a light one (flips and mild crops) otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, create_transform

from ..checkpoint import checkpoint_safe

#: the smallest training split that gets DeiT's policy by default: Tiny-ImageNet (100,000) and ImageNet are far above;
#: a few thousand images or fewer train for few steps per epoch, where the heavy policy keeps a model from fitting
DEIT_MIN_IMAGES = 10_000
#: the smallest crop side that gets DeiT's policy by default: Tiny-ImageNet's 64 px is the smallest size the paper's
#: recipes train at; below it RandAugment's magnitude-9 shears/translations and an erased patch cover most of an object
DEIT_MIN_SIZE = 64


@checkpoint_safe
@dataclass
class AugmentRecipe:
    """Training augmentation (timm argument names). The field defaults are DeiT's ImageNet policy, so a recipe given
    in part (``augment: {crop_pct: 1.0}``) is DeiT's with those fields changed; :meth:`light` is the other policy.

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

    @classmethod
    def light(cls) -> AugmentRecipe:
        """Horizontal flips and random-resized crops of 50-100% of the image; no RandAugment, colour jitter or
        random erasing: what small data sets and small images are given by default (:func:`recipe_for`)."""
        return cls(auto_augment=None, re_prob=0.0, color_jitter=0.0, scale=(0.5, 1.0))

    def describe(self) -> str:
        """The policy in words: ``DeiT's ImageNet policy (...)``, ``light (...)``, or the fields that differ."""
        if self == AugmentRecipe():
            return "DeiT's ImageNet policy (RandAugment m9, random erasing 0.25, crops of 8-100%, flips)"
        if self == AugmentRecipe.light():
            return "light (flips, crops of 50-100% of the image; no RandAugment, colour jitter or random erasing)"
        changed = {name: value for name, value in vars(self).items() if value != getattr(AugmentRecipe, name)}
        return "DeiT's ImageNet policy with " + ", ".join(f"{name}={value}" for name, value in changed.items())


def recipe_for(num_images: int, img_size: int) -> tuple[AugmentRecipe, str]:
    """The default recipe for ``num_images`` training images cropped to ``img_size`` px, with why, in words:
    DeiT's policy from :data:`DEIT_MIN_IMAGES` images at :data:`DEIT_MIN_SIZE` px up, :meth:`AugmentRecipe.light`
    below either."""
    large = num_images >= DEIT_MIN_IMAGES and img_size >= DEIT_MIN_SIZE
    recipe = AugmentRecipe() if large else AugmentRecipe.light()
    why = (
        f"{num_images} training images at {img_size} px; DeiT's policy is the default from {DEIT_MIN_IMAGES} "
        f"images at {DEIT_MIN_SIZE} px up, the light one below"
    )
    return recipe, why


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
        color_jitter=recipe.color_jitter or None,  # 0: no ColorJitter step at all, rather than one that does nothing
        scale=recipe.scale,
        hflip=recipe.hflip,
    )
