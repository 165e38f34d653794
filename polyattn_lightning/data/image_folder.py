"""ImageNet-1k style ``train/<class>/*`` and ``val/<class>/*`` folders."""
from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Sequence

from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset
from tqdm import tqdm

from ..errors import MissingPathError
from .base import CorruptImageError, DataModule, ImageList, read_rgb, require_dir
from .transforms import AugmentRecipe, build_transform

Samples = list[tuple[str, int]]
#: How many unreadable files an error message lists; ``polyattn check-data`` prints them all.
SHOWN_BAD_FILES = 20


def _read_error(path: str) -> str | None:
    try:
        read_rgb(path)
    except CorruptImageError as err:
        return str(err.__cause__ or err)
    return None


def find_unreadable_images(paths: Sequence[str], workers: int | None = None, progress: bool = True) -> dict[str, str]:
    """Every file of ``paths`` that PIL cannot decode, with why, from one pass over all of them.

    ``workers`` processes (default: every CPU) decode the files in parallel; ``progress`` shows a progress bar.
    """
    workers = workers or os.cpu_count() or 1
    bar = dict(total=len(paths), desc="checking images", unit="img", disable=not progress, mininterval=0.5)
    if workers == 1:
        results = tqdm(map(_read_error, paths), **bar)
        return {path: error for path, error in zip(paths, results) if error is not None}
    with ProcessPoolExecutor(workers) as pool:
        results = tqdm(pool.map(_read_error, paths, chunksize=max(1, min(256, len(paths) // (8 * workers)))), **bar)
        return {path: error for path, error in zip(paths, results) if error is not None}


def unreadable_message(bad: dict[str, str], total: int) -> str:
    """``N of M images cannot be read:`` and the first :data:`SHOWN_BAD_FILES` files with why."""
    lines = [f"  {path}: {error}" for path, error in list(bad.items())[:SHOWN_BAD_FILES]]
    if len(bad) > SHOWN_BAD_FILES:
        lines.append(f"  ... and {len(bad) - SHOWN_BAD_FILES} more (`polyattn check-data --config ...` lists all)")
    return "\n".join([f"{len(bad)} of {total} images cannot be read:", *lines])


class ImageFolderDataModule(DataModule):
    """Class-per-folder images (ImageNet-1k); classes are the sorted train folder names.

    Images are decoded lazily by the loader workers; a file PIL cannot read
    stops the run with an error naming it.
    """

    layout = "<root>/train/<class>/<image>.JPEG and <root>/val/<class>/<image>.JPEG (one folder per class)"

    def __init__(
        self,
        root: str,
        img_size: int = 224,
        augment: AugmentRecipe = AugmentRecipe(),
        batch_size: int = 64,
        num_workers: int = 8,
        pin_memory: bool = True,
        check_images: bool = False,
    ):
        """
        Args:
            root: the data set directory: <root>/train/<class>/<image> and <root>/val/<class>/<image>,
                one folder per class (relative paths are taken from the working directory).
            img_size: side of the square training and evaluation crops; must equal the model's ``img_size``.
            augment: training augmentation (DeiT's by default).
            batch_size: per-device batch size (the task scales the learning rate by the global batch).
            num_workers: loader worker processes per device, which decode the images.
            pin_memory: page-locked host memory for faster host-to-GPU copies (ignored without a CUDA device).
            check_images: before training, decode every image once (in parallel) and stop with a list of all the
                files that cannot be read, rather than at the first one mid-epoch.
        """
        super().__init__(batch_size=batch_size, num_workers=num_workers, pin_memory=pin_memory)
        self.root = Path(root).expanduser()
        self.img_size = img_size
        self.augment = augment
        self.check_images = check_images

    @classmethod
    def check_paths(cls, root: str, **_) -> None:
        """Called by the CLI before any model is built: ``root`` must be a non-empty directory."""
        require_dir(Path(root).expanduser(), cls.layout)

    def setup(self, stage: str | None = None) -> None:
        classes, train, val = self.find_samples(require_dir(self.root, self.layout))
        self.num_classes = len(classes)
        self.classes = classes  # names by class index, for predictions
        if self.check_images:
            paths = [path for path, _ in train + val]
            bad = find_unreadable_images(paths, workers=max(1, self.num_workers))
            if bad:
                raise CorruptImageError(unreadable_message(bad, len(paths)))
        self.train_set = ImageList(train, build_transform(self.img_size, True, self.augment))
        self.val_set = ImageList(val, build_transform(self.img_size, False, self.augment))

    def find_samples(self, root: Path) -> tuple[list[str], Samples, Samples]:
        """Class names and the ``(path, label)`` lists of the train and val splits."""
        train_dir = require_dir(root / "train", self.layout)
        val_dir = require_dir(root / "val", self.layout)
        try:
            classes, class_to_idx = find_classes(train_dir)
            unknown = sorted(set(find_classes(val_dir)[0]) - set(classes))
            if unknown:
                raise MissingPathError(f"{val_dir} has class folders that {train_dir} lacks: {unknown[:5]}")
            train = make_dataset(train_dir, class_to_idx, extensions=IMG_EXTENSIONS)
            val = make_dataset(val_dir, class_to_idx, extensions=IMG_EXTENSIONS, allow_empty=True)
        except FileNotFoundError as err:
            raise MissingPathError(f"{root}: {err}; expected layout:\n{self.layout}") from None
        if not val:
            raise MissingPathError(f"{val_dir} holds no images; expected layout:\n{self.layout}")
        return classes, train, val
