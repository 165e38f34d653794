"""A Pathfinder generator: dashed paths ("snakes") among distractors, written in the LRA release's layout.

Pathfinder (Linsley et al. 2018, "Learning long-range spatial dependencies with horizontal gated recurrent
units"; LRA's ``pathfinder32``, Path-X at 128 x 128 and Path-256) asks whether two marked dots lie on one
path. Every image here holds two *target* paths of ``contour_length`` dashes (14 for LRA's
``curv_contour_length_14``) and shorter distractor paths; a square marker sits at the ends of

* one target path, both of its ends: **connected** (label 1);
* each target path, one end each: **not connected** (label 0),

so both classes draw the same paths and differ only in where the markers are. A path is a chain of straight
dashes of ``segment`` pixels, ``gap`` blank pixels apart, each turned from the last by at most ``turn``
radians. Paths keep apart: no pixel of a path lies within ``gap + 1`` pixels (Chebyshev) of another path's
pixels, nor of its own dashes other than the neighbouring one. So "connected" has a pixel meaning: linking
the pixels within ``gap + 1`` of each other (a flood fill that steps over a dash's gap), the two markers are
in one component exactly when the label is 1 (``tests/lra/test_pathfinder_generator.py`` checks it). The
geometry per resolution is :data:`GEOMETRY` (32, 64, 128, 256 px; the dashes grow with the image, so a
path spans about the image's width at every size, as in LRA's Path-X).

Written as the release is (what :class:`~.pathfinder.PathfinderDataModule` reads)::

    pathfinder<res>/<difficulty>/imgs/<k>/sample_<i>.png        grayscale, 0 background, 255 ink
    pathfinder<res>/<difficulty>/metadata/<k>.npy               text despite the suffix, one line per image:
        imgs/<k> sample_<i>.png <i> <label> <turn> <contour_length> <distractor_length> <segment> <thickness> <gap> 1

Each image has its own random stream (``numpy`` seeded with ``(seed, resolution, index)``), so a set is the
same whatever the number of worker processes, and a longer set begins with a shorter one. Labels alternate
within each pair of images (a seeded coin decides the order): classes balanced to one image.

    python -m polyattn_lightning.data.lra pathfinder --out data/pathx --resolution 128 --num-images 200000
"""

from __future__ import annotations

import contextlib
import math
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from ...checkpoint import checkpoint_safe
from ...errors import ConfigError
from ...waits import Wait
from ..generated import cache_root, staged_dir

#: LRA's difficulties: the dashes per target path.
DIFFICULTIES = {"curv_baseline": 6, "curv_contour_length_9": 9, "curv_contour_length_14": 14}
INK = 255
#: The random stream of the labels: ``(seed, resolution, LABEL_STREAM)``, beyond every image's index.
LABEL_STREAM = 2**40


@dataclass(frozen=True)
class Geometry:
    """The drawing of one resolution, in pixels (``turn`` in radians)."""

    segment: int  # dash length
    gap: int  # blank pixels between two dashes of a path
    thickness: int  # dash width
    marker: int  # half-width of the square end markers: (2 marker + 1) pixels wide
    distractors: int  # distractor paths tried per image (one that finds no room is left out)
    turn: float  # at most this change of direction from one dash to the next


#: One path of 14 dashes is (segment + gap) * 14 pixels long: about the image's width at every resolution.
GEOMETRY = {
    32: Geometry(segment=2, gap=1, thickness=1, marker=1, distractors=6, turn=1.0),
    64: Geometry(segment=3, gap=1, thickness=1, marker=1, distractors=14, turn=0.8),
    128: Geometry(segment=6, gap=2, thickness=2, marker=2, distractors=24, turn=0.7),
    256: Geometry(segment=12, gap=4, thickness=3, marker=4, distractors=40, turn=0.7),
}


@checkpoint_safe
@dataclass(frozen=True)
class PathfinderSpec:
    """What :func:`write_dataset` makes: how many images, in folders of how many, from which seed.

    The resolution and difficulty are the reader's (``PathfinderDataModule(resolution=, difficulty=)``),
    so they are given in one place.
    """

    num_images: int = 200_000  # LRA's release: 200k images per difficulty
    images_per_folder: int = 1000
    seed: int = 0

    def __post_init__(self):
        if self.num_images < 2 or self.images_per_folder < 1:
            raise ConfigError(
                f"PathfinderSpec: num_images must be >= 2 and images_per_folder >= 1, got {self.num_images}, "
                f"{self.images_per_folder}"
            )

    def tag(self, resolution: int, difficulty: str) -> str:
        """A folder name that says what was generated."""
        return f"pathfinder{resolution}-{difficulty}-n{self.num_images}-per{self.images_per_folder}-seed{self.seed}"


def distractor_dashes(contour_length: int) -> int:
    """Dashes per distractor path: a third of a target path's (at least 2)."""
    return max(2, contour_length // 3)


def geometry(resolution: int, difficulty: str) -> tuple[Geometry, int]:
    """``(geometry, contour_length)``; a clear error for a resolution or difficulty without one."""
    if resolution not in GEOMETRY:
        raise ConfigError(
            f"Pathfinder generator: resolution {resolution} has no geometry; expected one of {sorted(GEOMETRY)}"
        )
    if difficulty not in DIFFICULTIES:
        raise ConfigError(
            f"Pathfinder generator: unknown difficulty {difficulty!r}; expected one of {sorted(DIFFICULTIES)}"
        )
    return GEOMETRY[resolution], DIFFICULTIES[difficulty]


class Canvas:
    """The image being drawn: the ink (which path drew each pixel) and, per pixel, what lies within reach.

    Reach is ``gap + 1`` pixels (Chebyshev). ``near`` is the one path with ink within reach (0: none, -1: two or
    more), ``low`` / ``high`` the first and last of its dashes there (a path numbers its dashes along itself).
    Testing a dash reads its own pixels only; drawing one rewrites the box around it, and keeps that box's old
    contents so that the dash can be taken back (a path that runs into a dead end backs up a dash and turns).
    """

    def __init__(self, size: int, geo: Geometry, rng: np.random.Generator):
        self.size, self.geo, self.rng = size, geo, rng
        self.maps = np.zeros((4, size, size), dtype=np.int32)  # one array, so a box of all four is one copy
        self.ink, self.near, self.low, self.high = self.maps
        reach = geo.gap + 1
        # per shape drawn (a dash's brush, a marker): its offsets, and those of the square within reach of it
        self.shapes = {
            radius: (square(radius), square(radius + reach)) for radius in ((geo.thickness - 1) / 2, geo.marker)
        }
        self.brush, self.block = self.shapes[(geo.thickness - 1) / 2][0], self.shapes[geo.marker][0]

    def stamp(self, centres: np.ndarray, shape: np.ndarray, margin: int = 0) -> np.ndarray | None:
        """The pixels of ``shape`` placed at each of ``centres`` (repeats kept); None if one falls within
        ``margin`` of the border or outside."""
        pixels = (centres[:, None, :] + shape[None]).reshape(-1, 2)
        if pixels.min() < margin or pixels.max() >= self.size - margin:
            return None
        return pixels

    def clear(self, pixels: np.ndarray, path: int, dash: int | None) -> bool:
        """No other path within reach of ``pixels``, nor this path's dashes other than ``dash``'s neighbours
        (None: any of its own dashes may be near, as for a marker)."""
        near, low, high = self.maps[1:, pixels[:, 0], pixels[:, 1]]
        if np.any((near != 0) & (near != path)):
            return False
        return dash is None or not np.any((near == path) & ((low < dash - 1) | (high > dash + 1)))

    def draw(self, centres: np.ndarray, radius: float, path: int, dash: int) -> tuple:
        """Ink the square of ``radius`` at each of ``centres`` as ``dash`` of ``path``; what :meth:`undo` needs to
        take it back."""
        shape, around = self.shapes[radius]
        pixels = (centres[:, None, :] + shape[None]).reshape(-1, 2)
        reached = (centres[:, None, :] + around[None]).reshape(-1, 2).clip(0, self.size - 1)
        lo, hi = reached.min(0), reached.max(0) + 1
        box = (slice(lo[0], hi[0]), slice(lo[1], hi[1]))
        undo = (box, self.maps[(slice(None), *box)].copy())
        self.ink[pixels[:, 0], pixels[:, 1]] = path
        within = np.zeros(hi - lo, dtype=bool)
        within[reached[:, 0] - lo[0], reached[:, 1] - lo[1]] = True
        near, low, high = self.near[box], self.low[box], self.high[box]  # views: written in place
        fresh, mine = within & (near == 0), within & (near == path)
        near[within & (near != 0) & (near != path)] = -1
        near[fresh], low[fresh], high[fresh] = path, dash, dash
        np.minimum(low, dash, out=low, where=mine)
        np.maximum(high, dash, out=high, where=mine)
        return undo

    def undo(self, record: tuple) -> None:
        box, saved = record
        self.maps[(slice(None), *box)] = saved

    def path(self, dashes: int, path: int, attempts: int = 10, tries: int = 8) -> tuple[np.ndarray, ...] | None:
        """Draw a path of ``dashes`` dashes grown from a random point both ways (``attempts`` fresh starts,
        ``tries`` turns per dash); its two end pixels, or None (nothing left drawn) if it found no room."""
        backward = dashes // 2  # dashes 0 .. backward - 1 grow from the start point the other way
        for _ in range(attempts):
            start, heading = self.rng.uniform(0, self.size, 2), self.rng.uniform(0, 2 * math.pi)
            records: list[tuple] = []
            ends = [self.grow(start, heading, range(backward, dashes), path, tries, records)]
            if ends[0] is not None and backward:
                back = start - (self.geo.gap + 1) * np.array([math.cos(heading), math.sin(heading)])
                ends.insert(0, self.grow(back, heading + math.pi, range(backward - 1, -1, -1), path, tries, records))
            if all(end is not None for end in ends):
                return ends[0], ends[-1]
            for record in reversed(records):  # stuck: start this path afresh
                self.undo(record)
        return None

    def grow(self, point, heading, order, path, tries, records) -> np.ndarray | None:
        """The dashes numbered ``order`` from ``point`` on, each turned at random from the last; at a dead end
        the last dash is taken back and drawn anew (at most ``tries`` times per dash in all). The last pixel,
        or None; every dash drawn is on ``records``."""
        geo, rng = self.geo, self.rng
        steps = np.arange(geo.segment, dtype=float)  # one sample a pixel: rounded, consecutive ones touch
        # the centres a dash may have: room for its brush and for a marker at an end
        low = geo.marker - self.brush.min()
        high = self.size - geo.marker - self.brush.max()
        placed: list[tuple] = []  # (point, heading) each drawn dash started from
        backups = 0
        while len(placed) < len(order):
            dash, turning = order[len(placed)], bool(placed)
            # the first dash of a half goes straight on
            turns = (heading + rng.uniform(-geo.turn, geo.turn, tries)).tolist() if turning else [heading]
            y, x = point.tolist()
            for turned in turns:
                cos, sin = math.cos(turned), math.sin(turned)
                tail_y, tail_x = y + (geo.segment - 1) * cos, x + (geo.segment - 1) * sin
                # off the canvas (most of a small image's misses): found in floats, without array work; round()
                # rounds half to even, as np.rint below
                if not (low <= round(min(y, tail_y)) and round(max(y, tail_y)) < high):
                    continue
                if not (low <= round(min(x, tail_x)) and round(max(x, tail_x)) < high):
                    continue
                direction = np.array([cos, sin])
                centres = np.rint(point + steps[:, None] * direction).astype(np.int64)
                pixels = self.stamp(centres, self.brush)
                if self.clear(pixels, path, dash):
                    records.append(self.draw(centres, (geo.thickness - 1) / 2, path, dash))
                    placed.append((point, heading))
                    last, heading, point = centres[-1], turned, point + (geo.segment + geo.gap) * direction
                    break
            else:
                backups += 1
                if len(placed) < 2 or backups > tries * len(order):
                    return None
                self.undo(records.pop())
                point, heading = placed.pop()
        return last

    def marker(self, centre: np.ndarray, path: int) -> bool:
        """A square marker on ``path`` at ``centre``, if no other path is within reach of it."""
        pixels = self.stamp(centre[None], self.block)
        if pixels is None or not self.clear(pixels, path, dash=None):
            return False
        self.draw(centre[None], self.geo.marker, path, dash=0)
        return True


def square(radius: float) -> np.ndarray:
    """The integer offsets of a square ``2 radius + 1`` wide (an even width when ``radius`` ends in .5)."""
    side = np.arange(-math.floor(radius), math.ceil(radius) + 1)
    return np.stack(np.meshgrid(side, side, indexing="ij"), -1).reshape(-1, 2)


def draw_image(resolution: int, difficulty: str, label: int, rng: np.random.Generator, attempts: int = 50):
    """``(pixels uint8 (res, res), markers (2, 2))`` of one image with ``label`` (1: the markers are joined)."""
    geo, contour = geometry(resolution, difficulty)
    for _ in range(attempts):
        canvas = Canvas(resolution, geo, rng)
        targets = [canvas.path(contour, path) for path in (1, 2)]
        if None in targets:
            continue
        first, second = targets
        ends = rng.permutation(2)
        if label:
            markers = [(first[0], 1), (first[1], 1)]
        else:
            markers = [(first[ends[0]], 1), (second[ends[1]], 2)]
        if not all(canvas.marker(centre, path) for centre, path in markers):
            continue
        for path in range(3, 3 + geo.distractors):
            canvas.path(distractor_dashes(contour), path, attempts=3)
        return (canvas.ink > 0).astype(np.uint8) * INK, np.stack([centre for centre, _ in markers])
    raise RuntimeError(f"no {resolution} px Pathfinder image fits after {attempts} attempts")  # not seen in tests


def labels(spec: PathfinderSpec, resolution: int) -> np.ndarray:
    """Label of every image: 0 and 1 in each pair, their order a seeded coin per pair."""
    coins = np.random.default_rng([spec.seed, resolution, LABEL_STREAM]).integers(0, 2, (spec.num_images + 1) // 2)
    return np.stack([coins, 1 - coins], axis=1).reshape(-1)[: spec.num_images]


def _write_folder(job: tuple) -> list[str]:
    """Draw and save the images of one folder; its metadata lines."""
    spec, resolution, difficulty, base, folder, indices, folder_labels = job
    geo, contour = geometry(resolution, difficulty)
    (base / "imgs" / str(folder)).mkdir(parents=True, exist_ok=True)
    lines = []
    for i, (index, label) in enumerate(zip(indices, folder_labels)):
        rng = np.random.default_rng([spec.seed, resolution, index])
        pixels, _ = draw_image(resolution, difficulty, int(label), rng)
        Image.fromarray(pixels).save(base / "imgs" / str(folder) / f"sample_{i}.png")
        lines.append(
            f"imgs/{folder} sample_{i}.png {i} {label} {geo.turn} {contour} {distractor_dashes(contour)} {geo.segment} "
            f"{geo.thickness} {geo.gap} 1"
        )
    return lines


def write_dataset(
    spec: PathfinderSpec,
    root: Path,
    resolution: int = 32,
    difficulty: str = "curv_contour_length_14",
    workers: int = 1,
    progress: bool = False,
) -> Path:
    """Generate ``root/pathfinder<res>/<difficulty>/`` (images and metadata); atomic, so a reader never sees half.

    ``workers`` processes draw the folders in parallel (the images do not depend on it). ``progress``: say it
    (:class:`~polyattn_lightning.waits.Wait`): the count of images drawn, their rate and the time left, and first,
    where the whole is expected to take more than a minute, an estimate from one image drawn beforehand.
    """
    geometry(resolution, difficulty)
    all_labels = labels(spec, resolution)
    parallel = min(workers, -(-spec.num_images // spec.images_per_folder))
    wait = Wait(f"drawing {spec.num_images} pathfinder{resolution} images", total=spec.num_images, unit="images")
    if progress:  # one image timed, for the estimate said first
        started = time.perf_counter()
        draw_image(resolution, difficulty, int(all_labels[0]), np.random.default_rng([spec.seed, resolution, 0]))
        seconds = time.perf_counter() - started
    with staged_dir(root) as staging, wait if progress else contextlib.nullcontext():
        if progress:
            wait.estimate(
                seconds * spec.num_images / parallel,
                f"one image took {seconds:.3g} s; {parallel} worker process{'es' if parallel > 1 else ''}",
            )
        base = staging / f"pathfinder{resolution}" / difficulty
        (base / "metadata").mkdir(parents=True)
        starts = range(0, spec.num_images, spec.images_per_folder)
        jobs = [
            (
                spec,
                resolution,
                difficulty,
                base,
                k,
                range(start, min(start + spec.images_per_folder, spec.num_images)),
                all_labels[start : start + spec.images_per_folder],
            )
            for k, start in enumerate(starts)
        ]
        with ProcessPoolExecutor(parallel) if parallel > 1 else contextlib.nullcontext() as pool:
            folders = []
            for lines in pool.map(_write_folder, jobs) if pool is not None else map(_write_folder, jobs):
                folders.append(lines)
                wait.add(len(lines))
        for k, lines in enumerate(folders):
            (base / "metadata" / f"{k}.npy").write_text("\n".join(lines) + "\n")
    return Path(root)


def default_root(spec: PathfinderSpec, resolution: int, difficulty: str) -> Path:
    """Where :class:`~.pathfinder.PathfinderDataModule` generates data when no root is given."""
    return cache_root("lra", spec.tag(resolution, difficulty))
