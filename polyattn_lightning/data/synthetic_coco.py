"""A seeded synthetic instance-segmentation set written in COCO 2017's on-disk layout.

Coloured rectangles, ellipses and triangles on textured backgrounds, with
polygon masks: enough structure for a detector to learn in minutes on a CPU,
in the very format (JSON + JPEG files) that :class:`~polyattn_lightning.data.coco.COCODataModule`
reads for real COCO, so the quickstart and the tests exercise the real loading path.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from ..errors import ConfigError
from .generated import cache_root, staged_dir

SHAPES = ("rectangle", "ellipse", "triangle")
SPLITS = ("train2017", "val2017")
#: Written last into a generated folder: its settings, so a later run reuses the folder only if they match.
MARKER = "synthetic_coco.json"


@dataclass(frozen=True)
class SyntheticCOCO:
    """Settings of the synthetic set; equal settings give byte-identical files.

    Attributes:
        train_images, val_images: images per split.
        image_size: side of the square images, in pixels.
        max_objects: 1 to this many shapes per image, placed without overlap (masks stay exact).
        min_size, max_size: a shape's bounding-box side as a fraction of the image side.
        classes: shape names, a subset of ``rectangle``, ``ellipse``, ``triangle``; the category order.
        seed: the generator's seed.
    """

    train_images: int = 400
    val_images: int = 50
    image_size: int = 128
    max_objects: int = 3
    min_size: float = 0.2
    max_size: float = 0.45
    classes: tuple[str, ...] = SHAPES
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "classes", tuple(self.classes))
        unknown = [name for name in self.classes if name not in SHAPES]
        if unknown or not self.classes:
            raise ConfigError(f"synthetic COCO classes must be a non-empty subset of {SHAPES}, got {self.classes}")
        if not 0 < self.min_size <= self.max_size < 1:
            raise ConfigError(
                f"synthetic COCO needs 0 < min_size <= max_size < 1, got {self.min_size}, {self.max_size}"
            )


def _background(rng: np.random.Generator, size: int) -> Image.Image:
    """A smooth colour gradient plus stripes or a checkerboard and noise: texture, never a flat colour."""
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) / size
    corner = rng.uniform(40, 215, (2, 2, 3))
    base = (
        corner[0, 0] * ((1 - x) * (1 - y))[..., None]
        + corner[0, 1] * (x * (1 - y))[..., None]
        + corner[1, 0] * ((1 - x) * y)[..., None]
        + corner[1, 1] * (x * y)[..., None]
    )
    period = rng.uniform(0.05, 0.2)
    if rng.random() < 0.5:
        angle = rng.uniform(0, math.pi)
        pattern = np.sin(2 * math.pi * (x * math.cos(angle) + y * math.sin(angle)) / period)
    else:
        pattern = np.sign(np.sin(2 * math.pi * x / period) * np.sin(2 * math.pi * y / period))
    texture = base + rng.uniform(10, 30) * pattern[..., None] + rng.normal(0, 6, (size, size, 3))
    return Image.fromarray(np.clip(texture, 0, 255).astype(np.uint8))


def _polygon(rng: np.random.Generator, shape: str, box: tuple[float, float, float, float]) -> list[tuple[float, float]]:
    """The outline of ``shape`` inside ``box`` = (x0, y0, x1, y1), as (x, y) points."""
    x0, y0, x1, y1 = box
    if shape == "rectangle":
        return [(x0, y0), (x1, y0), (x1, y1), (x0, y1)]
    if shape == "ellipse":
        cx, cy, rx, ry = (x0 + x1) / 2, (y0 + y1) / 2, (x1 - x0) / 2, (y1 - y0) / 2
        return [(cx + rx * math.cos(t), cy + ry * math.sin(t)) for t in np.linspace(0, 2 * math.pi, 32, endpoint=False)]
    apex = rng.uniform(x0, x1)  # triangle: apex on the top edge, base on the bottom edge
    return [(apex, y0), (x1, y1), (x0, y1)] if rng.random() < 0.5 else [(x0, y0), (x1, y0), (apex, y1)]


def _image(rng: np.random.Generator, config: SyntheticCOCO) -> tuple[Image.Image, list[dict]]:
    """One image and its objects (category index, polygon)."""
    size = config.image_size
    image = _background(rng, size)
    draw = ImageDraw.Draw(image)
    placed: list[tuple[float, float, float, float]] = []
    objects = []
    for _ in range(int(rng.integers(1, config.max_objects + 1))):
        for _attempt in range(20):  # rejection sampling: boxes never overlap, so no mask is occluded
            w, h = rng.uniform(config.min_size, config.max_size, 2) * size
            x0, y0 = rng.uniform(1, size - w - 1), rng.uniform(1, size - h - 1)
            box = (x0, y0, x0 + w, y0 + h)
            if all(box[2] < p[0] or p[2] < box[0] or box[3] < p[1] or p[3] < box[1] for p in placed):
                break
        else:
            continue
        placed.append(box)
        label = int(rng.integers(len(config.classes)))
        points = _polygon(rng, config.classes[label], box)
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        draw.polygon(points, fill=colour, outline=colour)
        objects.append({"label": label, "points": points})
    return image, objects


def _annotation(obj: dict, ann_id: int, image_id: int, size: int) -> dict:
    xs = [min(max(x, 0.0), size) for x, _ in obj["points"]]
    ys = [min(max(y, 0.0), size) for _, y in obj["points"]]
    area = 0.5 * abs(sum(xs[i] * ys[i - 1] - xs[i - 1] * ys[i] for i in range(len(xs))))  # shoelace
    x0, y0 = min(xs), min(ys)
    return {
        "id": ann_id,
        "image_id": image_id,
        "category_id": obj["label"] + 1,
        "segmentation": [[round(v, 2) for point in zip(xs, ys) for v in point]],
        "bbox": [round(x0, 2), round(y0, 2), round(max(xs) - x0, 2), round(max(ys) - y0, 2)],
        "area": round(area, 2),
        "iscrowd": 0,
    }


def write_synthetic_coco(root: str | Path, config: SyntheticCOCO = SyntheticCOCO()) -> Path:
    """Write the set under ``root`` in COCO 2017's layout; returns ``root``.

    ``root`` gets ``annotations/instances_{train,val}2017.json``, ``train2017/``
    and ``val2017/`` (JPEG files), written through :func:`~.generated.staged_dir`
    (replacing an earlier set), so an interrupted run never leaves a half-written
    set behind that a later run would take for complete.
    """
    root = Path(root)
    if root.exists() and any(root.iterdir()) and not (root / MARKER).is_file():
        raise ConfigError(
            f"{root} is not empty and was not generated by polyattn_lightning's synthetic COCO writer "
            f"(no {MARKER}); choose another synthetic_root or pass --data.root for a real data set"
        )
    with staged_dir(root, replace=True) as staging:  # replaces only a set written here before
        rng = np.random.default_rng(config.seed)
        categories = [{"id": i + 1, "name": name, "supercategory": "shape"} for i, name in enumerate(config.classes)]
        image_id, ann_id = 0, 0
        (staging / "annotations").mkdir()
        for split, count in zip(SPLITS, (config.train_images, config.val_images)):
            (staging / split).mkdir()
            images, annotations = [], []
            for _ in range(count):
                image_id += 1
                image, objects = _image(rng, config)
                file_name = f"{image_id:012d}.jpg"
                image.save(staging / split / file_name, format="JPEG", quality=92)
                images.append(
                    {"id": image_id, "file_name": file_name, "height": config.image_size, "width": config.image_size}
                )
                for obj in objects:
                    ann_id += 1
                    annotations.append(_annotation(obj, ann_id, image_id, config.image_size))
            coco = {
                "info": {"description": "polyattn_lightning synthetic shapes", **_settings(config)},
                "images": images,
                "annotations": annotations,
                "categories": categories,
            }
            (staging / "annotations" / f"instances_{split}.json").write_text(json.dumps(coco))
        (staging / MARKER).write_text(json.dumps(_settings(config), indent=1))
    return root


def _settings(config: SyntheticCOCO) -> dict:
    return {**asdict(config), "classes": list(config.classes)}


def default_root() -> Path:
    """Where the quickstart generates the set when no folder is given: ``$XDG_CACHE_HOME/polyattn_lightning/
    synthetic_coco`` (``~/.cache/...`` without ``XDG_CACHE_HOME``), beside the generated LRA sets."""
    return cache_root("synthetic_coco")


def ensure_synthetic_coco(root: str | Path, config: SyntheticCOCO = SyntheticCOCO()) -> Path:
    """``root`` holding the set for ``config``: reused when its marker matches, (re)generated otherwise.

    Only a folder this module generated (it has the marker file) is ever
    replaced; any other non-empty folder at ``root`` is an error (see :func:`write_synthetic_coco`).
    """
    marker = Path(root) / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == _settings(config):
        return Path(root)
    return write_synthetic_coco(root, config)
