"""The Pathfinder generator (``data/lra/snakes.py``): its files read by the LRA reader, balanced labels, the
markers of a "connected" image joined by one path and those of a "not connected" one not (an independent flood
fill), every resolution, seeded determinism, generation on first use, and the command line."""
from __future__ import annotations

from collections import deque
import numpy as np
import pytest
from PIL import Image

from polyattn_lightning.data.lra import PathfinderDataModule, PathfinderSpec
from polyattn_lightning.data.lra.__main__ import main as lra_main
from polyattn_lightning.data.lra.snakes import GEOMETRY, default_root, draw_image, write_dataset
from polyattn_lightning.errors import ConfigError

HARD = "curv_contour_length_14"


def components(ink: np.ndarray, link: int) -> np.ndarray:
    """Component id of every ink pixel (0: background), ink pixels within ``link`` (Chebyshev) joined: a flood
    fill that steps over the blank gap between two dashes of a path."""
    ids = np.zeros(ink.shape, dtype=np.int64)
    size, count = ink.shape[0], 0
    for start in zip(*np.nonzero(ink)):
        if ids[start]:
            continue
        count += 1
        ids[start], queue = count, deque([start])
        while queue:
            y, x = queue.popleft()
            for ny in range(max(0, y - link), min(size, y + link + 1)):
                for nx in range(max(0, x - link), min(size, x + link + 1)):
                    if ink[ny, nx] and not ids[ny, nx]:
                        ids[ny, nx] = count
                        queue.append((ny, nx))
    return ids


@pytest.mark.parametrize("resolution, count", [(32, 12), (64, 4), (128, 2), (256, 2)])
def test_connected_means_one_path_between_the_markers(resolution, count):
    """Label 1: the two markers are in one component; label 0: in two, however the paths wind."""
    geo = GEOMETRY[resolution]
    for index in range(count):
        label = index % 2
        pixels, markers = draw_image(resolution, HARD, label, np.random.default_rng([7, resolution, index]))
        assert pixels.shape == (resolution, resolution) and set(np.unique(pixels)) == {0, 255}
        for y, x in markers:  # a full square marker, wider than a dash
            m = geo.marker
            assert (pixels[y - m : y + m + 1, x - m : x + m + 1] == 255).all()
        ids = components(pixels > 0, link=geo.gap + 1)
        (a, b) = (ids[tuple(marker)] for marker in markers)
        assert a and b and (a == b) == bool(label), (resolution, index, label)
        assert len(np.unique(ids)) - 1 >= 2  # the second target path (and distractors) are drawn as well


def test_written_files_are_read_by_the_lra_reader_with_balanced_labels(tmp_path):
    spec = PathfinderSpec(num_images=25, images_per_folder=10, seed=1)
    root = write_dataset(spec, tmp_path / "pf", resolution=32)
    base = root / "pathfinder32" / HARD
    assert sorted(p.name for p in (base / "metadata").iterdir()) == ["0.npy", "1.npy", "2.npy"]
    lines = [line.split() for k in range(3) for line in (base / "metadata" / f"{k}.npy").read_text().splitlines()]
    assert len(lines) == 25 and lines[0][:4] == ["imgs/0", "sample_0.png", "0", lines[0][3]]
    assert [len(fields) for fields in lines] == [11] * 25  # the release's fields, the contour length 6th
    assert {fields[5] for fields in lines} == {"14"}
    labels = [int(fields[3]) for fields in lines]
    assert abs(sum(labels) - 12.5) <= 0.5  # 12 or 13 of 25
    dm = PathfinderDataModule(root=str(root), batch_size=4)
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (21, 2, 2)  # the reader's seeded 80/10/10 split
    (pixels,), label = dm.train_set.dataset[7]
    on_disk = np.asarray(Image.open(base / "imgs" / "0" / "sample_7.png"))
    assert label == labels[7] and np.array_equal(pixels, on_disk.reshape(-1))
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (4, 1024) and batch["mask"].all()


def test_labels_are_balanced_in_every_pair_and_images_repeat_with_the_seed(tmp_path):
    spec = PathfinderSpec(num_images=6, images_per_folder=6, seed=3)
    first, again = (write_dataset(spec, tmp_path / name, resolution=32) for name in ("a", "b"))
    other = write_dataset(PathfinderSpec(num_images=6, images_per_folder=6, seed=4), tmp_path / "c", resolution=32)
    parallel = write_dataset(PathfinderSpec(num_images=6, images_per_folder=4, seed=3), tmp_path / "d", 32, workers=2)

    def images(root, per_folder=6):
        base = root / "pathfinder32" / HARD / "imgs"
        return [np.asarray(Image.open(base / str(i // per_folder) / f"sample_{i % per_folder}.png")) for i in range(6)]

    def labels(root):
        meta = sorted((root / "pathfinder32" / HARD / "metadata").iterdir(), key=lambda p: int(p.stem))
        return [int(line.split()[3]) for path in meta for line in path.read_text().splitlines()]

    assert all(np.array_equal(x, y) for x, y in zip(images(first), images(again)))
    assert all(np.array_equal(x, y) for x, y in zip(images(first), images(parallel, per_folder=4)))
    assert not all(np.array_equal(x, y) for x, y in zip(images(first), images(other)))
    assert labels(first) == labels(parallel)
    for found in (labels(first), labels(other)):
        assert all(found[i] + found[i + 1] == 1 for i in range(0, 6, 2))


def test_resolutions_and_difficulties(tmp_path):
    root = write_dataset(PathfinderSpec(num_images=10), tmp_path / "x", resolution=128, difficulty="curv_baseline")
    dm = PathfinderDataModule(root=str(root), resolution=128, difficulty="curv_baseline", batch_size=2)
    dm.setup("fit")
    assert dm.max_length == 128 * 128 and dm.train_set.dataset[0][0][0].shape == (16384,)
    meta = (root / "pathfinder128" / "curv_baseline" / "metadata" / "0.npy").read_text().split()
    assert meta[5] == "6"  # curv_baseline: 6 dashes per target path
    with pytest.raises(ConfigError, match=r"resolution 100 has no geometry; expected one of \[32, 64, 128, 256\]"):
        PathfinderDataModule(generate=PathfinderSpec(), resolution=100)
    with pytest.raises(ConfigError, match="unknown difficulty 'curv_hard'"):
        write_dataset(PathfinderSpec(num_images=2), tmp_path / "y", difficulty="curv_hard")
    with pytest.raises(ConfigError, match="num_images must be >= 2"):
        PathfinderSpec(num_images=1)


def test_the_data_module_generates_on_first_use_and_reuses_it(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    spec = PathfinderSpec(num_images=10, seed=2)
    dm = PathfinderDataModule(generate=spec, batch_size=2)
    dm.prepare_data()
    root = default_root(spec, 32, HARD)
    assert root.is_relative_to(tmp_path / "cache") and (root / "pathfinder32" / HARD / "metadata" / "0.npy").is_file()
    stamp = (root / "pathfinder32" / HARD / "metadata" / "0.npy").stat().st_mtime_ns
    again = PathfinderDataModule(generate=spec, batch_size=2)
    again.setup("fit")
    assert (root / "pathfinder32" / HARD / "metadata" / "0.npy").stat().st_mtime_ns == stamp  # read, not redrawn
    assert len(again.train_set) + len(again.val_set) + len(again.test_set) == 10
    given = write_dataset(PathfinderSpec(num_images=12, seed=5), tmp_path / "given")
    with_root = PathfinderDataModule(root=str(given), generate=spec, batch_size=2)
    with_root.setup("fit")  # a given root is read, never generated into
    assert len(with_root.train_set) + len(with_root.val_set) + len(with_root.test_set) == 12


def test_command_line(tmp_path, capsys):
    out = tmp_path / "made"
    lra_main(["pathfinder", "--out", str(out), "--resolution", "64", "--num-images", "4", "--workers", "1"])
    assert "wrote 4 images" in capsys.readouterr().out
    assert len(list((out / "pathfinder64" / HARD / "imgs" / "0").glob("sample_*.png"))) == 4
    with pytest.raises(SystemExit):
        lra_main(["pathfinder", "--out", str(out)])
    assert f"{out} exists" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        lra_main(["pathfinder", "--out", str(tmp_path / "other"), "--resolution", "100"])
    assert "invalid choice: 100" in capsys.readouterr().err

