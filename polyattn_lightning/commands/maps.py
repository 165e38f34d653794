"""``polyattn maps --ckpt RUN.ckpt --image IMG [--image IMG ...] [--layer 2 --layer 12] [--head 0] --out DIR``

Draws the attention pictures of :mod:`~polyattn_lightning.callbacks.attention_maps`
(``DIR/heatmaps.png``: phi(S) per layer and head; ``DIR/overlay.png``: where the
model looks, over each image) for a trained checkpoint and image files.
The images get timm's evaluation transform (resize, centre crop, normalise)
at the model's input size, normalised as the run's data module did: its mean and std are read from the config
saved beside the checkpoint (:func:`run_normalisation`); ``--mean``/``--std`` given win, and ImageNet's are used
where no saved config says.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import NamedTuple

import torch
import yaml
from lightning.pytorch import LightningModule
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, create_transform

from .. import tasks
from ..diagnostics.figures import attention_pictures
from ..checkpoint import load_checkpoint
from ..cli.config import class_from_path
from ..cli.runs import checkpoint_run_dir, newest_saved_config
from ..data.base import read_rgb
from ..errors import ArgumentParser, ConfigError
from ..sharding.checkpoints import check_sharded_folder, in_memory_file, read_consolidated


def layer_ref(text: str) -> int | str:
    """A 1-based layer number, or a module name."""
    return int(text) if text.isdigit() else text


def module_class(name: str) -> type[LightningModule]:
    """A LightningModule class: a short name of this project's tasks or ``package.module.Class``."""
    if hasattr(tasks, name):
        return getattr(tasks, name)
    module, _, attr = name.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), attr) if module else None
    except (ImportError, AttributeError):
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, LightningModule)):
        raise ConfigError(
            f"--model-class {name!r} is not a LightningModule (a task name such as ClassificationModule "
            "or a dotted path package.module.Class)"
        )
    return cls


def load_module(ckpt: Path, class_name: str | None) -> LightningModule:
    """The module of a checkpoint, built from its hyperparameters (no pretrained file needed), in eval mode.

    The class is ``class_name``, else the one the CLI recorded (``_class_path``), else ``ClassificationModule``.
    A sharded checkpoint folder is consolidated in memory first (:func:`~..sharding.read_consolidated`).
    """
    if ckpt.is_dir():
        checkpoint = read_consolidated(check_sharded_folder(ckpt))
        source = in_memory_file(checkpoint)
    else:
        checkpoint, source = load_checkpoint(ckpt), ckpt  # names the file if it is damaged
    if "hyper_parameters" not in checkpoint or "state_dict" not in checkpoint:
        raise ConfigError(f"{ckpt} is not a Lightning checkpoint of a module that saves its hyperparameters")
    hparams = checkpoint["hyper_parameters"]
    cls = module_class(class_name or hparams.get("_class_path") or "ClassificationModule")
    overrides = {"pretrained": None} if hparams.get("pretrained") else {}  # the checkpoint's weights replace them
    # Lightning's loader: it also rebuilds hyperparameters the CLI saved as plain dicts (recipes) into their types
    module = cls.load_from_checkpoint(source, map_location="cpu", weights_only=True, **overrides)
    print(
        f"checkpoint {ckpt}: {cls.__name__}, {len(checkpoint['state_dict'])} tensors loaded, saved at epoch "
        f"{checkpoint.get('epoch')}, step {checkpoint.get('global_step')}"
    )
    return module.eval()


def input_size(module: LightningModule, given: int | None) -> int:
    """The image side: ``--img-size``, else the ``img_size`` hyperparameter, else the patch embedding's."""
    if given:
        return given
    size = module.hparams.get("img_size") or getattr(getattr(module.model, "patch_embed", None), "img_size", None)
    if size is None:
        raise ConfigError("cannot tell the model's input size; pass --img-size")
    return size if isinstance(size, int) else size[0]


class Normalisation(NamedTuple):
    """The per-channel mean and std images are normalised with, and where each was taken from, in words."""

    mean: tuple[float, ...]
    std: tuple[float, ...]
    mean_from: str
    std_from: str

    def describe(self) -> str:
        """``mean 0.5 0.5 0.5, std 0.5 0.5 0.5 (where from)``."""

        def numbers(values: tuple[float, ...]) -> str:
            return " ".join(f"{value:g}" for value in values)

        if self.mean_from == self.std_from:
            return f"mean {numbers(self.mean)}, std {numbers(self.std)} ({self.mean_from})"
        return f"mean {numbers(self.mean)} ({self.mean_from}), std {numbers(self.std)} ({self.std_from})"


def run_normalisation(ckpt: Path) -> Normalisation | None:
    """How the checkpoint's run normalised its images: its data module's
    (:meth:`~..data.base.DataModule.normalisation`) with the init arguments of the config saved in its run folder
    (:func:`~..cli.runs.newest_saved_config`); None where there is no such config or its data module does not say."""
    config_path = newest_saved_config(checkpoint_run_dir(ckpt))
    config = yaml.safe_load(config_path.read_text()) if config_path else None
    data = config.get("data") if isinstance(config, dict) else None
    cls = class_from_path(data.get("class_path")) if isinstance(data, dict) else None
    found = cls.normalisation(data.get("init_args") or {}) if hasattr(cls, "normalisation") else None
    if found is None:
        return None
    source = f"{cls.__name__} in {config_path}"
    return Normalisation(tuple(found[0]), tuple(found[1]), source, source)


def normalisation(args) -> Normalisation:
    """``--mean``/``--std`` where given, else the run's (:func:`run_normalisation`), else ImageNet's."""
    run = run_normalisation(args.ckpt) if args.mean is None or args.std is None else None
    fallback = "ImageNet's: no config saved beside the checkpoint says; give --mean/--std"
    default = run or Normalisation(IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, fallback, fallback)
    return Normalisation(
        default.mean if args.mean is None else tuple(args.mean),
        default.std if args.std is None else tuple(args.std),
        default.mean_from if args.mean is None else "--mean",
        default.std_from if args.std is None else "--std",
    )


def parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="polyattn maps",
        description=(
            "Heat maps of phi(S) per layer and head, and where the model looks over each image, for a checkpoint "
            "and image files: writes OUT/heatmaps.png and OUT/overlay.png."
        ),
    )
    p.add_argument("--ckpt", type=Path, required=True, help="checkpoint of a trained run")
    p.add_argument("--image", type=Path, action="append", required=True, help="image file (repeat for several)")
    p.add_argument(
        "--layer",
        type=layer_ref,
        action="append",
        help="1-based attention layer or module name (repeat); default: every layer",
    )
    p.add_argument("--head", type=int, action="append", help="0-based head (repeat); default: every head")
    p.add_argument("--out", type=Path, required=True, help="directory for heatmaps.png and overlay.png")
    p.add_argument(
        "--model-class",
        help="the checkpoint's LightningModule class (default: the one the CLI recorded in "
        "it, else ClassificationModule)",
    )
    p.add_argument("--img-size", type=int, help="input side (default: the model's)")
    p.add_argument(
        "--mean",
        type=float,
        nargs=3,
        help="normalisation mean (default: the run's, from the config saved beside the checkpoint; else ImageNet's)",
    )
    p.add_argument("--std", type=float, nargs=3, help="normalisation std (default: the run's, as --mean)")
    p.add_argument("--dpi", type=int, default=100)
    return p


def main(argv: list[str] | None = None) -> list[Path]:
    """Run the command; returns the PNG files written."""
    args = parser().parse_args(argv)
    module = load_module(args.ckpt, args.model_class)
    size = input_size(module, args.img_size)
    norm = normalisation(args)
    print(f"normalisation: {norm.describe()}")
    transform = create_transform(input_size=size, is_training=False, crop_pct=1.0, mean=norm.mean, std=norm.std)
    images = torch.stack([transform(read_rgb(path)) for path in args.image])
    caption = f"\n{args.ckpt.name}: {', '.join(path.name for path in args.image)}"
    figures = attention_pictures(module, images, args.layer, args.head, samples=len(args.image), caption=caption)
    args.out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fig in figures.items():
        written.append(args.out / f"{name}.png")
        fig.savefig(written[-1], dpi=args.dpi)
        print(f"wrote {written[-1]}")
    return written
