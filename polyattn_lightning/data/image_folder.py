"""ImageNet-1k style ``train/<class>/*`` and ``val/<class>/*`` folders."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

from .. import waits
from ..errors import MissingPathError
from .base import DataModule, ImageList, available_cpus, require_dir
from .image_check import require_readable
from .transforms import AugmentRecipe, build_transform, recipe_for

Samples = list[tuple[str, int]]


class ImageFolderDataModule(DataModule):
    """Class-per-folder images (ImageNet-1k); classes are the sorted train folder names.

    Images are decoded lazily by the loader workers; a file PIL cannot read
    stops the run with an error naming it. Training augmentation not given is chosen from the data at ``setup``
    (:func:`~.transforms.recipe_for`: DeiT's ImageNet policy for large sets of large images, a light one otherwise)
    and said in one info line, with why. Indexing a large folder (ImageNet's million files) says so
    (:class:`~polyattn_lightning.waits.Wait`) once it lasts.
    """

    layout = "<root>/train/<class>/<image>.JPEG and <root>/val/<class>/<image>.JPEG (one folder per class)"
    sample_noun = "images"

    def __init__(
        self,
        root: str,
        img_size: int = 224,
        augment: AugmentRecipe | None = None,
        batch_size: int = 64,
        num_workers: int = available_cpus(),
        pin_memory: bool = True,
        check_images: bool = False,
        predict_root: str | None = None,
    ):
        """
        Args:
            root: the data set directory: <root>/train/<class>/<image> and <root>/val/<class>/<image>,
                one folder per class (relative paths are taken from the working directory).
            img_size: side of the square training and evaluation crops; must equal the model's ``img_size``.
            augment: training augmentation; None (the default) chooses it from the training split at ``setup``:
                DeiT's ImageNet policy from 10,000 images at 64 px up, else :meth:`AugmentRecipe.light` (flips and
                crops of 50-100%). A recipe given in part is DeiT's with those fields changed.
            batch_size: per-device batch size (the task scales the learning rate by the global batch).
            num_workers: loader worker processes per device, which decode the images (default: the CPUs this
                process may use, at most 8).
            pin_memory: page-locked host memory for faster host-to-GPU copies (ignored without a CUDA device).
            check_images: before training, decode every image once (in parallel) and stop with a list of all the
                files that cannot be read, rather than at the first one mid-epoch.
            predict_root: ``predict`` reads every image under this folder (any layout, no labels) instead of the
                validation split; its files and class probabilities go to the predictions file.
        """
        super().__init__(batch_size=batch_size, num_workers=num_workers, pin_memory=pin_memory)
        self.root = Path(root).expanduser()
        self.img_size = img_size
        self.augment = augment
        self.recipe: AugmentRecipe | None = augment  # the one in use: chosen at setup when not given
        self.check_images = check_images
        self.predict_root = None if predict_root is None else Path(predict_root).expanduser()

    @classmethod
    def check_paths(cls, root: str, **_) -> None:
        """Called by the CLI before any model is built: ``root`` must be a non-empty directory."""
        require_dir(Path(root).expanduser(), cls.layout)

    def setup(self, stage: str | None = None) -> None:
        with waits.Wait(f"{type(self).__name__}: indexing the images under {self.root}", after=waits.QUIET_SECONDS):
            classes, train, val = self.find_samples(require_dir(self.root, self.layout))
        self.num_classes = len(classes)
        self.classes = classes  # names by class index, for predictions
        if self.check_images:
            require_readable([path for path, _ in train + val])
        if self.augment is None:
            self.recipe, why = recipe_for(len(train), self.img_size)
        else:
            self.recipe, why = self.augment, "as given"
        if stage in ("fit", None):
            rank_zero_info(f"{type(self).__name__}: training augmentation {self.recipe.describe()}: {why}")
        self.train_set = ImageList(train, build_transform(self.img_size, True, self.recipe))
        self.val_set = ImageList(val, build_transform(self.img_size, False, self.recipe))
        if stage == "predict" and self.predict_root is not None:
            self.predict_set = ImageList(self.predict_samples(), build_transform(self.img_size, False, self.recipe))

    def predict_samples(self) -> Samples:
        """Every image file under ``predict_root`` (sorted, any depth), labelled -1: nothing to score against."""
        root = self.predict_root
        if not root.is_dir():
            raise MissingPathError(f"--data.predict_root {root}: no such folder (it should hold the images to predict)")
        files = sorted(str(p) for p in root.rglob("*") if p.is_file() and p.suffix.lower() in IMG_EXTENSIONS)
        if not files:
            raise MissingPathError(f"--data.predict_root {root} holds no image files ({', '.join(IMG_EXTENSIONS)})")
        return [(path, -1) for path in files]

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
