"""ImageNet-1k style ``train/<class>/*`` and ``val/<class>/*`` folders."""
from __future__ import annotations

from pathlib import Path

from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

from .base import ImageDataModule, ImageList, require_dir
from .transforms import AugmentRecipe, build_transform

Samples = list[tuple[str, int]]


class ImageFolderDataModule(ImageDataModule):
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
    ):
        """
        Args:
            root: the data set directory (see ``layout``).
            img_size: side of the square training and evaluation crops.
            augment: training augmentation (DeiT's by default).
        """
        super().__init__(batch_size=batch_size, num_workers=num_workers, pin_memory=pin_memory)
        self.root = Path(root).expanduser()
        self.img_size = img_size
        self.augment = augment

    def setup(self, stage: str | None = None) -> None:
        classes, train, val = self.find_samples(require_dir(self.root, self.layout))
        self.num_classes = len(classes)
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
                raise FileNotFoundError(f"{val_dir} has class folders that {train_dir} lacks: {unknown[:5]}")
            train = make_dataset(train_dir, class_to_idx, extensions=IMG_EXTENSIONS)
            val = make_dataset(val_dir, class_to_idx, extensions=IMG_EXTENSIONS, allow_empty=True)
        except FileNotFoundError as err:
            raise FileNotFoundError(f"{root}: {err}; expected layout:\n{self.layout}") from None
        if not val:
            raise FileNotFoundError(f"{val_dir} holds no images; expected layout:\n{self.layout}")
        return classes, train, val
