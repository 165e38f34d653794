"""A small image folder a new user might bring: circles, squares and triangles drawn at random sizes, places and
colours on a white background, as PNG files in ``train/<class>/`` and ``val/<class>/`` (60 images at 32 px by default).

On ``sys.path`` for the tests (``import shapes_folder``); also a command, for the README's evidence runs:
``python tests/shapes_folder.py DIR``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

SHAPES = ("circle", "square", "triangle")


def draw_shape(shape: str, size: int, rng: np.random.Generator) -> Image.Image:
    """One ``size`` px RGB image: ``shape`` of a random side (40-80% of the image) at a random place, on white, in a
    random colour at least 150 from white (sum over the channels), so the shape is always seen."""
    colour = rng.integers(0, 256, 3)
    while 3 * 255 - colour.sum() < 150:
        colour = rng.integers(0, 256, 3)
    image = Image.new("RGB", (size, size), (255, 255, 255))
    side = int(rng.integers(int(0.4 * size), int(0.8 * size) + 1))
    x, y = (int(v) for v in rng.integers(0, size - side + 1, 2))
    box = (x, y, x + side - 1, y + side - 1)
    draw, fill = ImageDraw.Draw(image), tuple(int(c) for c in colour)
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(x + side / 2, y), (x, y + side - 1), (x + side - 1, y + side - 1)], fill=fill)
    return image


def write_shapes(root: Path, train_per_class: int = 15, val_per_class: int = 5, size: int = 32, seed: int = 0) -> Path:
    """``root/{train,val}/{circle,square,triangle}/<n>.png``: ``3 * (train_per_class + val_per_class)`` images."""
    rng = np.random.default_rng(seed)
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for shape in SHAPES:
            folder = root / split / shape
            folder.mkdir(parents=True, exist_ok=True)
            for index in range(count):
                draw_shape(shape, size, rng).save(folder / f"{index}.png")
    return root


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/shapes_folder.py DIR  (writes DIR/{train,val}/{circle,square,triangle}/*.png)")
    print(write_shapes(Path(sys.argv[1])))
