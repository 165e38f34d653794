"""COCO-format instance segmentation: mmdet's ``CocoDataset`` and transforms behind a LightningDataModule.

The data set, the transforms (built from config dicts with mmdet's registry)
and the collate function (mmengine's ``pseudo_collate``) are mmdet's own, so a
batch is exactly what mmdet's detectors and ``CocoMetric`` expect. This module
adds what mmdet leaves to its Runner or gets wrong for other data sets:

* the classes default to the annotation file's categories, in its order
  (mmdet's ``CocoDataset`` would keep only the 80 COCO names and silently drop
  every annotation of another data set), and configured classes must match them;
* a broken layout or file is reported by path, image id or category before
  training, or when the image is loaded, rather than as an assertion deep in a
  transform or collate function;
* the project's loaders: training resumes mid-epoch, evaluation counts every
  image once under DDP;
* with no ``root``, a synthetic set (:mod:`.synthetic_coco`) is generated on first use.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
from pathlib import Path
from typing import Any, Sequence

from .. import waits
from ..errors import ConfigError, DataError, MissingPathError
from .base import DataModule
from .image_check import require_readable
from .synthetic_coco import SyntheticCOCO, default_root, ensure_synthetic_coco

LAYOUT = """  <root>/annotations/instances_train2017.json
  <root>/annotations/instances_val2017.json
  <root>/train2017/<file_name of each image in the train annotations>
  <root>/val2017/<file_name of each image in the val annotations>"""

#: The 3x recipe's training sizes: short side 480, 512, ..., 800 (XCiT and mmdet's Swin ms-crop-3x configs).
COCO_SHORT_SIDES = tuple(range(480, 801, 32))


class COCODataError(DataError):
    """A COCO annotation file or image folder that does not hold what it should; the message names it."""


def _mmdet():
    """mmdet's data set class, registries and collate function, importable once the mmcv op shim is installed."""
    # installs the mmcv ops mmdet imports and fills mmdet's registries with the mmdet default scope, in which
    # nested transforms (RandomChoice's) look their types up
    from .. import detection  # noqa: F401
    from mmdet.datasets import CocoDataset
    from mmdet.registry import TRANSFORMS
    from mmengine.dataset import pseudo_collate

    return CocoDataset, TRANSFORMS, pseudo_collate


def read_annotations(ann_file: Path, img_dir: Path) -> list[dict]:
    """Check a COCO annotation file against its image folder; returns its categories in file order.

    Every annotation must name a listed image and a listed category, and every
    listed image must be a file in ``img_dir``.
    """
    if not ann_file.is_file():
        raise MissingPathError(f"annotation file {ann_file} does not exist; expected layout:\n{LAYOUT}")
    if not img_dir.is_dir():
        raise MissingPathError(f"image directory {img_dir} does not exist; expected layout:\n{LAYOUT}")
    try:
        coco = json.loads(ann_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise COCODataError(f"cannot read COCO annotation file {ann_file}: {err}") from err
    missing_keys = [key for key in ("images", "annotations", "categories") if key not in coco]
    if missing_keys:
        raise COCODataError(f"{ann_file} is not a COCO instances file: it has no {missing_keys}")
    categories = {cat["id"]: cat["name"] for cat in coco["categories"]}
    images = {image["id"]: image["file_name"] for image in coco["images"]}
    for ann in coco["annotations"]:
        if ann["image_id"] not in images:
            raise COCODataError(
                f"{ann_file}: annotation {ann['id']} refers to image id {ann['image_id']}, "
                "which is not in the file's images"
            )
        if ann["category_id"] not in categories:
            raise COCODataError(
                f"{ann_file}: annotation {ann['id']} of image id {ann['image_id']} has category id "
                f"{ann['category_id']}, which is not in the file's categories {sorted(categories)}"
            )
    on_disk = set(os.listdir(img_dir))
    absent = [(image_id, name) for image_id, name in images.items() if name not in on_disk]
    if absent:
        listed = ", ".join(f"id {i}: {name}" for i, name in absent[:5])
        raise COCODataError(
            f"{ann_file} lists {len(absent)} image(s) missing from {img_dir} ({listed}"
            + (", ...)" if len(absent) > 5 else ")")
        )
    return coco["categories"]


def check_classes(configured: list[str] | None, in_file: list[str], ann_file: Path) -> list[str]:
    """The classes to train on: the file's categories, which configured ``classes`` must equal, order included
    (the label of a category is its position in the file)."""
    if configured is None or list(configured) == in_file:
        return in_file
    not_in_file = [name for name in configured if name not in in_file]
    not_configured = [name for name in in_file if name not in configured]
    if not_in_file or not_configured:
        difference = f"configured but not in the file: {not_in_file}; in the file but not configured: {not_configured}"
    else:
        difference = f"same names in another order; the file's order is {in_file}"
    raise COCODataError(
        f"data classes do not match the categories of {ann_file}: {difference}. "
        "Leave classes unset to use the file's categories."
    )


class ImageLoadError(DataError):
    """Loading or transforming one image failed; the message names the annotation file, image id and path."""


def _checked_dataset_class(base: type) -> type:
    """``base`` (mmdet's CocoDataset) whose per-image failures name the image."""

    class CheckedCocoDataset(base):
        def prepare_data(self, idx: int) -> Any:
            try:
                return super().prepare_data(idx)
            except Exception as err:
                info = self.get_data_info(idx)
                raise ImageLoadError(
                    f"{self.ann_file}: image id {info['img_id']} ({info['img_path']}): {type(err).__name__}: {err}"
                ) from err

    return CheckedCocoDataset


class COCODataModule(DataModule):
    """COCO 2017's layout (or any COCO-format set laid out the same way) through mmdet's ``CocoDataset``.

    Training: random flip, then with probability 1/2 a resize to a random short
    side from ``train_sizes`` (long side <= ``max_side``), else DETR's
    resize-crop-resize (short side from ``crop_sizes``, a random crop of
    ``crop_size``, then a resize as before); images without annotations or
    shorter than ``min_size`` are left out, as mmdet does. Evaluation: a resize to
    short side ``test_size``. Batches are mmengine ``pseudo_collate`` dicts
    (``inputs``: uint8 CHW tensors, ``data_samples``: ``DetDataSample``) that the
    detector's data preprocessor normalises and pads. Loaders come from
    :class:`~polyattn_lightning.data.base.DataModule`: training resumes
    mid-epoch, each image augmented by (seed, epoch, index) alone (mmdet's
    transforms draw from numpy's global RNG); evaluation counts every image
    once under DDP.
    """

    drop_last_train = False  # no Mixup: every training image is used

    def __init__(
        self,
        root: str | None = None,
        classes: list[str] | None = None,
        batch_size: int = 2,
        num_workers: int = 2,
        train_sizes: list[int] = list(COCO_SHORT_SIDES),
        crop_sizes: list[int] | None = [400, 500, 600],
        crop_size: tuple[int, int] = (384, 600),
        max_side: int = 1333,
        test_size: int = 800,
        min_size: int = 32,
        synthetic: SyntheticCOCO | None = None,
        synthetic_root: str | None = None,
        check_images: bool = False,
    ):
        """
        Args:
            root: the data set folder (see :data:`LAYOUT`). It must exist: a missing
                folder is an error, never a reason to generate data.
            classes: category names; unset, the annotation file's categories in its order.
                Given, they must equal those.
            batch_size: images per device and step (the XCiT 3x recipe: 2, on 8 GPUs).
            num_workers: loader processes per device.
            train_sizes: training short sides to choose from (long side capped at ``max_side``).
            crop_sizes: short sides before the random crop of the resize-crop-resize branch; None turns
                that branch off (only the multi-scale resize remains).
            crop_size: the crop's height and width range, ``(min, max)`` pixels (``absolute_range``).
            max_side: the long side never exceeds this.
            test_size: the evaluation short side.
            min_size: training images with a shorter side are left out (mmdet: 32).
            synthetic: settings of a synthetic shapes set to train on when ``root`` is not given
                (generated on first use into ``synthetic_root``, regenerated when the settings change);
                None requires ``root``.
            synthetic_root: where the synthetic set is written; default
                ``$XDG_CACHE_HOME/polyattn_lightning/synthetic_coco`` (``~/.cache/...``).
            check_images: in ``setup``, decode every listed image once (in parallel) and stop with a list of all
                the files that cannot be read, rather than at the first one mid-epoch.
        """
        super().__init__(batch_size=batch_size, num_workers=num_workers, pin_memory=False)
        self.root = root
        self.given_classes = classes
        self.train_sizes = list(train_sizes)
        self.crop_sizes = list(crop_sizes) if crop_sizes else None
        self.crop_size = tuple(crop_size)
        self.max_side = max_side
        self.test_size = test_size
        self.min_size = min_size
        self.synthetic = synthetic
        self.synthetic_root = synthetic_root
        self.check_images = check_images
        self.classes: list[str] | None = None  # the classes trained on, read from the annotation files in setup()
        self.category_ids: list[int] | None = None  # the annotation file's id of each class, by label

    # ---- where the data is -------------------------------------------------------------------------

    @property
    def data_root(self) -> Path:
        if self.root is not None:
            return Path(self.root)
        if self.synthetic is None:
            raise ConfigError(
                "COCODataModule needs --data.init_args.root (a folder laid out as:\n"
                f"{LAYOUT}\n), or synthetic settings to generate a synthetic set"
            )
        return Path(self.synthetic_root).expanduser() if self.synthetic_root else default_root()

    def split_paths(self, split: str) -> tuple[Path, Path]:
        """``(annotation file, image folder)`` of ``split`` (``train2017`` or ``val2017``)."""
        return self.data_root / "annotations" / f"instances_{split}.json", self.data_root / split

    @property
    def val_ann_file(self) -> Path:
        """The annotation file that ``CocoMetric`` scores the validation (and test, predict) images against."""
        return self.split_paths("val2017")[0]

    @property
    def num_classes(self) -> int | None:
        """The category count of the annotation files, once ``setup()`` has read them."""
        return None if self.classes is None else len(self.classes)

    @classmethod
    def check_paths(cls, root: str | None = None, **_) -> None:
        """Called by the CLI before any model is built: a given ``root`` must be a directory."""
        if root is not None and not Path(root).is_dir():
            raise MissingPathError(f"data root {root} does not exist; expected layout:\n{LAYOUT}")

    def prepare_data(self) -> None:
        """Generate the synthetic set when no root is given (Lightning calls this on one process per node)."""
        if self.root is None and self.synthetic is not None:
            ensure_synthetic_coco(self.data_root, self.synthetic)

    # ---- data sets ---------------------------------------------------------------------------------

    def setup(self, stage: str) -> None:
        root = self.data_root
        self.check_paths(str(root))
        splits = ["train2017", "val2017"] if stage == "fit" else ["val2017"]
        for split in splits:
            ann_file, img_dir = self.split_paths(split)
            with waits.Wait(f"checking the COCO annotations {ann_file}", after=waits.QUIET_SECONDS):
                categories = read_annotations(ann_file, img_dir)
            classes = check_classes(self.given_classes, [cat["name"] for cat in categories], ann_file)
            if self.classes is not None and classes != self.classes:
                raise COCODataError(
                    f"the categories of {ann_file} ({classes}) differ from those of the other split ({self.classes})"
                )
            self.classes, self.category_ids = classes, [cat["id"] for cat in categories]
        if self.check_images:
            require_readable(self.image_files(splits))
        if stage == "fit":
            self.train_set = self._dataset("train2017", train=True)
        self.val_set = self._dataset("val2017", train=False)

    def image_files(self, splits: Sequence[str] = ("train2017", "val2017")) -> list[str]:
        """The image file of every image the annotation files of ``splits`` list (read without mmdet)."""
        files = []
        for split in splits:
            ann_file, img_dir = self.split_paths(split)
            if not ann_file.is_file():
                raise MissingPathError(f"annotation file {ann_file} does not exist; expected layout:\n{LAYOUT}")
            try:
                images = json.loads(ann_file.read_text())["images"]
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
                raise COCODataError(f"cannot read the images of COCO annotation file {ann_file}: {err}") from err
            files += [str(img_dir / image["file_name"]) for image in images]
        return files

    def _dataset(self, split: str, train: bool):
        CocoDataset, transforms, _ = _mmdet()
        ann_file, img_dir = self.split_paths(split)
        pipeline = self._train_pipeline() if train else self._test_pipeline()
        loading = waits.Wait(
            f"loading the COCO annotations {ann_file} into mmdet's CocoDataset", after=waits.QUIET_SECONDS
        )
        with loading, contextlib.redirect_stdout(io.StringIO()) as chatter:  # pycocotools' "loading annotations ..."
            dataset = _checked_dataset_class(CocoDataset)(
                ann_file=str(ann_file),
                data_prefix={"img": str(img_dir)},
                metainfo={"classes": tuple(self.classes)},
                filter_cfg={"filter_empty_gt": True, "min_size": self.min_size} if train else None,
                pipeline=[transforms.build(step) for step in pipeline],
                test_mode=not train,
            )
        logging.getLogger(__name__).debug(chatter.getvalue())
        if len(dataset) == 0:
            raise COCODataError(
                f"{ann_file}: no image left for {'training' if train else 'evaluation'} "
                f"(training keeps images with annotations and a side of at least {self.min_size} px)"
            )
        return dataset

    def _train_pipeline(self) -> list[dict]:
        resize = {
            "type": "RandomChoiceResize",
            "scales": [(s, self.max_side) for s in self.train_sizes],
            "keep_ratio": True,
        }
        branches = [[resize]]
        if self.crop_sizes:
            branches.append(
                [
                    {
                        "type": "RandomChoiceResize",
                        "scales": [(s, self.max_side) for s in self.crop_sizes],
                        "keep_ratio": True,
                    },
                    {
                        "type": "RandomCrop",
                        "crop_type": "absolute_range",
                        "crop_size": self.crop_size,
                        "allow_negative_crop": True,
                    },
                    resize,
                ]
            )
        return [
            {"type": "LoadImageFromFile"},
            {"type": "LoadAnnotations", "with_bbox": True, "with_mask": True},
            {"type": "RandomFlip", "prob": 0.5},
            {"type": "RandomChoice", "transforms": branches},
            {"type": "PackDetInputs"},
        ]

    def _test_pipeline(self) -> list[dict]:
        # no annotations: CocoMetric scores against the annotation file
        return [
            {"type": "LoadImageFromFile"},
            {"type": "Resize", "scale": (self.test_size, self.max_side), "keep_ratio": True},
            {"type": "PackDetInputs", "meta_keys": ("img_id", "img_path", "ori_shape", "img_shape", "scale_factor")},
        ]

    @property
    def collate_fn(self):
        """mmengine's ``pseudo_collate``, imported on first use like the rest of mmdet."""
        return _mmdet()[2]
