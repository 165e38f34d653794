"""LRA Pathfinder: are two dots joined by a dashed path? Grayscale PNGs as pixel sequences.

The release's ``pathfinder32/<difficulty>/metadata/<k>.npy`` are plain text despite
the suffix: one image per line, space-separated, field 0 the image folder
(``imgs/<k>``), field 1 the file name, field 3 the label; the image is
``pathfinder32/<difficulty>/<field 0>/<field 1>``. As in google-research/long-range-arena
(``lra_benchmarks/data/pathfinder.py`` and ``image/input_pipeline.py``): the PNG's
pixel values (0-255) are the tokens, row by row (vocabulary 256, length 1024 at
32 x 32), and empty image files are dropped (the release has one). LRA's task is
``curv_contour_length_14`` ("hard") at 32 x 32; Path-X is the same task at 128 x 128
(``pathfinder128/``, 16,384 tokens), and Path-256 at 256 x 256 (``pathfinder256/``,
65,536 tokens). All images are decoded once, in ``setup`` (200k images take 0.2 GB
at 32 px, 3.3 GB at 128 px, 13 GB at 256 px).

Without ``root`` and with ``generate``, :mod:`.snakes` draws the set on first use in
``$XDG_CACHE_HOME/polyattn_lightning/lra/<what was generated>`` (``~/.cache`` without
``XDG_CACHE_HOME``), in this layout, and it is read from there afterwards.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from lightning.pytorch.utilities import rank_zero_warn
from PIL import Image
from torch.utils.data import Dataset

from ...errors import DataError, MissingPathError
from ..image_check import require_readable
from ..base import available_cpus
from .base import LRADataModule, Sequences, TokenDataset, fraction_sizes, parse_label, seeded_split
from .snakes import PathfinderSpec, default_root, geometry, write_dataset


def _metadata_order(path: Path):
    return (0, int(path.stem), "") if path.stem.isdigit() else (1, 0, path.stem)


class PathfinderDataModule(LRADataModule):
    """LRA Pathfinder (2 classes); ``--data.root`` is the LRA release folder holding ``pathfinder32/``, or
    ``generate`` makes the set on first use (a given ``root`` is always read, never generated into).

    One seeded 80/10/10 split of every listed image into train/validation/test.
    Unreadable, empty or missing image files are skipped, with one warning that counts them.
    """

    vocab_size = 256
    num_classes = 2
    layout = (
        "pathfinder<resolution>/<difficulty>/metadata/<k>.npy (text, one image per line: <folder> <file> <index> "
        "<label>) and pathfinder<resolution>/<difficulty>/imgs/<k>/sample_<i>.png (grayscale)"
    )

    def __init__(
        self,
        root: str | None = None,
        generate: PathfinderSpec | None = None,
        resolution: int = 32,
        difficulty: str = "curv_contour_length_14",
        split_seed: int = 0,
        batch_size: int = 256,
        num_workers: int = 0,
        pin_memory: bool = False,
        check_images: bool = False,
    ):
        """
        Args:
            generate: the set to draw when ``root`` is not given (:class:`~.snakes.PathfinderSpec`: how many
                images, the seed), at this ``resolution`` and ``difficulty``.
            resolution: 32 (LRA's Pathfinder), 64, 128 (Path-X) or 256 (Path-256): reads ``pathfinder<resolution>/``.
            difficulty: ``curv_baseline``, ``curv_contour_length_9`` or ``curv_contour_length_14`` (LRA's).
            check_images: decode every listed image first (in parallel) and stop with a list of all the files
                that cannot be read, instead of skipping them with one warning.
        """
        super().__init__(root, resolution * resolution, False, split_seed, batch_size, num_workers, pin_memory)
        if generate is not None:
            geometry(resolution, difficulty)  # a resolution or difficulty the generator cannot draw fails here
        self.resolution, self.difficulty, self.generate = resolution, difficulty, generate
        self.check_images = check_images
        self.folder = Path(f"pathfinder{resolution}") / difficulty
        self.layout = (
            f"{self.folder}/metadata/<k>.npy (text, one image per line: <folder> <file> <index> <label>) "
            f"and {self.folder}/imgs/<k>/sample_<i>.png ({resolution} x {resolution} grayscale)"
        )

    def prepare_data(self) -> None:
        self.data_root()  # generates on one process per node; the others wait, then read it

    def data_root(self) -> Path:
        if self.root is not None or self.generate is None:
            return super().data_root()
        root = default_root(self.generate, self.resolution, self.difficulty)
        if not (root / self.folder).is_dir():
            workers = min(available_cpus(cap=None), -(-self.generate.num_images // self.generate.images_per_folder))
            write_dataset(self.generate, root, self.resolution, self.difficulty, workers=workers, progress=True)
        return root

    def read_metadata(self, base: Path) -> list[tuple[Path, int]]:
        meta_dir = base / "metadata"
        files = sorted(meta_dir.glob("*.npy"), key=_metadata_order) if meta_dir.is_dir() else []
        if not files:
            raise MissingPathError(f"no metadata files {meta_dir}/*.npy; expected layout:\n{self.layout}")
        samples = []
        for path in files:
            for line_no, line in enumerate(path.read_text().splitlines(), 1):
                fields = line.split()
                if not fields:
                    continue
                where = f"{path}:{line_no}"
                if len(fields) < 4:
                    raise DataError(f"{where}: expected '<folder> <file> <index> <label> ...', got {line!r}")
                samples.append((base / fields[0] / fields[1], parse_label(fields[3], 2, where)))
        return samples

    def read_image(self, path: Path) -> np.ndarray | None:
        """The image's pixels as one row, or None if the file is missing, empty or not an image."""
        try:
            with Image.open(path) as image:
                pixels = np.asarray(image if image.mode == "L" else image.convert("L"))
        except (OSError, ValueError, SyntaxError):  # missing, empty (PIL: cannot identify), truncated, corrupt
            return None
        if pixels.shape != (self.resolution, self.resolution):
            raise DataError(
                f"{path}: image is {pixels.shape[1]} x {pixels.shape[0]}, "
                f"expected {self.resolution} x {self.resolution}"
            )
        return pixels.reshape(-1)

    def image_files(self) -> list[str]:
        """Every image the metadata files list (read without loading the images)."""
        return [str(path) for path, _ in self.read_metadata(self.data_root() / self.folder)]

    def load(self, root: Path) -> tuple[Dataset, Dataset, Dataset]:
        samples = self.read_metadata(root / self.folder)
        if self.check_images:
            require_readable([str(path) for path, _ in samples])
        pixels, labels, skipped = [], [], []
        for path, label in samples:
            row = self.read_image(path)
            if row is None:
                skipped.append(path)
            else:
                pixels.append(row)
                labels.append(label)
        if skipped:
            rank_zero_warn(
                f"{root / self.folder}: skipped {len(skipped)} of {len(samples)} listed images that are missing, "
                f"empty or unreadable (first: {skipped[0]})"
            )
        if not pixels:
            raise MissingPathError(f"no readable images under {root / self.folder}; expected layout:\n{self.layout}")
        dataset = TokenDataset([Sequences.from_array(np.stack(pixels))], labels)
        return tuple(
            seeded_split(
                dataset,
                fraction_sizes(len(dataset), [0.8, 0.1, 0.1]),
                self.split_seed,
                names=["training", "validation", "test"],
            )
        )
