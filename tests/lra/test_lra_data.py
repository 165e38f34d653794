"""LRA loaders on tiny files in the official formats: ids against hand-computed values, masks from true
lengths (black pixels attended), seeded splits, and errors naming the file and line.

(Named test_lra_data.py: a second test_data.py beside tests/classification/test_data.py breaks
pytest's collection in the package-less test layout.)
"""
from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from polyattn_lightning.data.lra import (
    AANDataModule,
    CIFAR10GrayDataModule,
    IMDbDataModule,
    PadCollate,
    PathfinderDataModule,
    SequenceBuilder,
    TokenDataset,
)
from polyattn_lightning.data.lra.image import to_grayscale
from polyattn_lightning.errors import DataError, MissingPathError


def batches(dm, split="train"):
    dm.setup("fit")
    return list(getattr(dm, f"{split}_dataloader")())


# --- padding and masks -------------------------------------------------------------------------------


def test_collate_pads_to_multiple_of_64_and_masks_true_lengths():
    samples = [((np.array([5, 0, 7]),), 1), ((np.zeros(70, dtype=np.int64),), 0)]
    batch = PadCollate(max_length=1000)(samples)
    assert batch["input_ids"].shape == batch["mask"].shape == (2, 128)
    assert batch["input_ids"].dtype == torch.long and batch["mask"].dtype == torch.bool
    assert batch["label"].tolist() == [1, 0] and batch["label"].dtype == torch.long
    assert batch["input_ids"][0, :4].tolist() == [5, 0, 7, 0]
    # the mask follows the lengths, not the ids: real zeros are attended, padding zeros are not
    assert batch["mask"].sum(1).tolist() == [3, 70]
    assert batch["mask"][0, :3].all() and not batch["mask"][0, 3:].any()
    assert PadCollate(max_length=100)(samples)["input_ids"].shape == (2, 100)  # never beyond max_length
    assert PadCollate(max_length=1000, fixed_length=True)(samples)["mask"].shape == (2, 1000)


def test_collate_two_towers_masks_each_document():
    samples = [((np.array([1, 2]), np.arange(1, 81)), 1), ((np.array([3]), np.array([4, 5, 6])), 0)]
    batch = PadCollate(max_length=4000)(samples)
    assert batch["input_ids"].shape == batch["mask"].shape == (2, 2, 128)
    assert batch["mask"].sum(-1).tolist() == [[2, 80], [1, 3]]
    assert batch["input_ids"][1, 1, :4].tolist() == [4, 5, 6, 0]


def test_builder_truncates_and_counts_once():
    builder = SequenceBuilder(max_length=4, source="somefile")
    for seq in (b"abcdef", b"ab", np.arange(9, dtype=np.uint8)):
        builder.append(seq)
    with pytest.warns(UserWarning, match="somefile: 2 of 3 sequences are longer than 4 tokens; truncated"):
        sequences = builder.build()
    data = TokenDataset([sequences], [0, 1, 0], shift=1)
    assert data[0][0][0].tolist() == [98, 99, 100, 101]  # b"abcd" + 1
    assert sequences.lengths().tolist() == [4, 2, 4]


# --- Text: the aclImdb layout ------------------------------------------------------------------------


def write_imdb(root: Path) -> Path:
    reviews = {
        "train/pos/0_9.txt": "Great film!\n",
        "train/pos/1_8.txt": "  Caf\u00e9 scene <br /> \"wow\"",
        "train/neg/0_1.txt": "Bad.",
        "train/neg/1_2.txt": "x" * 150,
        "test/pos/0_10.txt": "Yes",
        "test/neg/0_3.txt": "No",
    }
    for name, text in reviews.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(text.encode("utf-8"))
    (root / "train" / "unsup").mkdir()  # present in the real folder, not read
    return root


def test_imdb_bytes_plus_one_labels_and_validation(tmp_path):
    dm = IMDbDataModule(root=str(write_imdb(tmp_path / "aclImdb")), max_length=100, batch_size=4)
    with pytest.warns(UserWarning, match=r"train: 1 of 4 sequences are longer than 100 tokens"):
        dm.setup("fit")
    assert (dm.vocab_size, dm.num_classes, dm.two_tower) == (257, 2, False)
    assert dm.val_set is dm.test_set  # LRA: the test set doubles as validation
    # sorted files, neg (0) first: "Bad.", "x"*150, then pos (1): "Great film!", stripped "Caf\xc3\xa9 ..."
    seqs = [dm.train_set[i] for i in range(4)]
    assert [label for _, label in seqs] == [0, 0, 1, 1]
    assert seqs[0][0][0].tolist() == [b + 1 for b in b"Bad."]
    assert len(seqs[1][0][0]) == 100
    assert seqs[3][0][0][:5].tolist() == [ord("C") + 1, ord("a") + 1, ord("f") + 1, 0xC3 + 1, 0xA9 + 1]
    held_out = IMDbDataModule(root=str(tmp_path / "aclImdb"), max_length=100, val_fraction=0.5)
    with pytest.warns(UserWarning, match="longer than 100"):
        held_out.setup()
    assert (len(held_out.train_set), len(held_out.val_set), len(held_out.test_set)) == (2, 2, 2)


def test_imdb_missing_folder_names_layout(tmp_path):
    root = write_imdb(tmp_path / "aclImdb")
    for path in (root / "test" / "neg").iterdir():
        path.unlink()
    with pytest.raises(FileNotFoundError, match=r"no reviews in .*test/neg; expected layout"):
        IMDbDataModule(root=str(root)).setup()


# --- Retrieval: headerless 5-column AAN files --------------------------------------------------------

def write_aan(root: Path, rows: dict[str, list[str]] | None = None) -> Path:
    default = [
        '1.0\tD07-1001\tP05-1022\tA "quoted text, with commas\tShort',
        "0.0\tD07-1002\tJ93-2004\t" + "b" * 90 + "\tsecond doc",
        "1.0\tD07-1003\tP05-1023\tthird\tfourth",
    ]
    for split in ("train", "eval", "test"):
        path = root / "tsv_data" / f"new_aan_pairs.{split}.tsv"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(("\n".join((rows or {}).get(split, default)) + "\n").encode())
    return root


def test_aan_two_towers_bytes_and_masks(tmp_path):
    dm = AANDataModule(root=str(write_aan(tmp_path / "lra_release")), max_length=80, batch_size=3)
    assert (dm.vocab_size, dm.num_classes, dm.two_tower) == (257, 2, True)
    with pytest.warns(UserWarning, match=r"text1\): 1 of 3 sequences are longer than 80"):
        dm.setup("fit")
    (first, second), label = dm.test_set[0]
    assert label == 1 and dm.test_set[1][1] == 0
    assert first.tolist() == [b + 1 for b in b'A "quoted text, with commas'] and second.tolist() == [b + 1 for b in b"Short"]
    batch = list(dm.test_dataloader())[0]
    assert batch["input_ids"].shape == batch["mask"].shape == (3, 2, 80)
    assert batch["mask"].sum(-1).tolist() == [[27, 5], [80, 10], [5, 6]]
    assert batch["label"].tolist() == [1, 0, 1]


@pytest.mark.parametrize(
    "row, message",
    [
        ("1.0\tA\tB\tonly four", r"new_aan_pairs\.eval\.tsv:2: expected 5 tab-separated columns"),
        ("2.0\tA\tB\tx\ty", r"new_aan_pairs\.eval\.tsv:2: label '2\.0' is not a class in 0\.\.1"),
        ("0.5\tA\tB\tx\ty", r"new_aan_pairs\.eval\.tsv:2: label '0\.5'"),
        ("1.0\tA\tB\t\ty", r"new_aan_pairs\.eval\.tsv:2: text1 is empty"),
    ],
)
def test_aan_malformed_row_names_file_and_line(tmp_path, row, message):
    root = write_aan(tmp_path, {"eval": ["0.0\tA\tB\tfine\tfine", row]})
    with pytest.raises(ValueError, match=message):
        AANDataModule(root=str(root)).setup()


def test_aan_missing_file(tmp_path):
    root = write_aan(tmp_path)
    (root / "tsv_data" / "new_aan_pairs.test.tsv").unlink()
    with pytest.raises(FileNotFoundError, match=r"missing .*new_aan_pairs\.test\.tsv; expected layout"):
        AANDataModule(root=str(root)).setup()


# --- Image: CIFAR-10 python pickle batches ----------------------------------------------------------


class Py2Pickler(pickle._Pickler):
    """Writes bytes and str as Python 2 ``str`` opcodes, as the release's cPickle files have them."""

    def save_bytes(self, obj):
        n = len(obj)
        self.write(pickle.SHORT_BINSTRING + bytes([n]) + obj if n < 256 else pickle.BINSTRING + n.to_bytes(4, "little") + obj)
        self.memoize(obj)

    def save_str(self, obj):
        self.save_bytes(obj.encode("latin1"))

    dispatch = {**pickle._Pickler.dispatch, bytes: save_bytes, str: save_str}


def write_cifar(root: Path, n_per_batch: int = 4) -> Path:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i, name in enumerate([f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]):
        data = rng.integers(0, 256, (n_per_batch, 3072), dtype=np.uint8)
        data[0] = 0  # a black image
        batch = {
            b"batch_label": f"batch {i}".encode(),
            b"labels": [(i + j) % 10 for j in range(n_per_batch)],
            b"data": data,
            b"filenames": [f"img_{i}_{j}.png".encode() for j in range(n_per_batch)],
        }
        with open(folder / name, "wb") as f:
            if name == "test_batch":  # as the release: Python 2 pickle, str keys (read back as bytes)
                Py2Pickler(f, protocol=2).dump({key.decode(): value for key, value in batch.items()})
            else:
                pickle.dump(batch, f, protocol=2)
    return root


def test_grayscale_matches_tensorflow_formula():
    # hand-computed: floor(255.5 * (0.2989 r + 0.5870 g + 0.1140 b) / 255)
    rgb = np.array([[255, 0, 0], [0, 255, 0], [0, 0, 255], [100, 150, 200], [255, 255, 255], [0, 0, 0]], dtype=np.uint8)
    gray = to_grayscale(rgb.T[None])  # (1, 3, 6): channel planes
    assert gray.tolist() == [[76, 149, 29, 141, 255, 0]]


def test_cifar_pickles_split_and_black_pixels_attended(tmp_path):
    root = write_cifar(tmp_path)
    dm = CIFAR10GrayDataModule(root=str(root), val_size=5, batch_size=20)
    assert (dm.vocab_size, dm.num_classes, dm.max_length, dm.two_tower) == (256, 10, 1024, False)
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (15, 5, 4)
    assert not set(dm.train_set.indices) & set(dm.val_set.indices)
    again = CIFAR10GrayDataModule(root=str(root), val_size=5)
    again.setup()
    assert again.val_set.indices == dm.val_set.indices  # seeded
    test = list(dm.test_dataloader())[0]
    assert test["input_ids"].shape == test["mask"].shape == (4, 1024)
    assert (test["input_ids"][0] == 0).all() and test["mask"].all()  # black pixels are tokens, attended
    with open(root / "cifar-10-batches-py" / "test_batch", "rb") as f:
        raw = pickle.load(f, encoding="bytes")
    assert test["input_ids"][1].tolist() == to_grayscale(raw[b"data"][1:2].reshape(1, 3, 1024))[0].tolist()
    assert test["label"].tolist() == raw[b"labels"]


def test_cifar_bad_files(tmp_path):
    root = write_cifar(tmp_path)
    (root / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(MissingPathError, match=r"missing .*data_batch_3; expected layout"):
        CIFAR10GrayDataModule(root=str(root), val_size=5).setup()
    with open(root / "cifar-10-batches-py" / "data_batch_3", "wb") as f:
        pickle.dump({b"data": Path("x"), b"labels": []}, f)  # a class that is not an array: refused
    with pytest.raises(DataError, match=r"data_batch_3: not a CIFAR-10 python batch .*refusing to load pathlib"):
        CIFAR10GrayDataModule(root=str(root), val_size=5).setup()
    with pytest.raises(MissingPathError, match=r"data root .*missing does not exist"):
        CIFAR10GrayDataModule(root=str(tmp_path / "missing")).setup()
    # the CLI's check before any model is built: the same error
    with pytest.raises(MissingPathError, match=r"data root .*missing does not exist; expected layout:\ncifar-10"):
        CIFAR10GrayDataModule.check_paths(root=str(tmp_path / "missing"), val_size=5)
    CIFAR10GrayDataModule.check_paths(root=str(root))


# --- Pathfinder: text-format .npy metadata and PNGs --------------------------------------------------


def write_pathfinder(root: Path, n: int = 20) -> Path:
    base = root / "pathfinder32" / "curv_contour_length_14"
    (base / "metadata").mkdir(parents=True)
    lines = {0: [], 1: []}
    for i in range(n):
        k = i % 2
        pixels = np.zeros((32, 32), dtype=np.uint8)
        pixels[i % 32, :] = 255 - i  # one bright row on black
        path = base / "imgs" / str(k) / f"sample_{i}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels, mode="L").save(path)
        lines[k].append(f"imgs/{k} sample_{i}.png {i} {i % 2} 2 14 1.5 2")
    (base / "imgs" / "0" / "sample_empty.png").write_bytes(b"")  # the release has an empty image
    lines[0].append("imgs/0 sample_empty.png 99 1 2 14 1.5 2")
    (base / "imgs" / "1" / "sample_bad.png").write_bytes(b"not a png")
    lines[1].append("imgs/1 sample_bad.png 98 0 2 14 1.5 2")
    for k, entries in lines.items():
        (base / "metadata" / f"{k}.npy").write_text("\n".join(entries) + "\n")
    return root


def test_pathfinder_reads_metadata_skips_bad_images_once(tmp_path):
    root = write_pathfinder(tmp_path / "lra_release")
    dm = PathfinderDataModule(root=str(root), batch_size=32)
    assert (dm.vocab_size, dm.num_classes, dm.max_length, dm.two_tower) == (256, 2, 1024, False)
    with pytest.warns(UserWarning, match=r"skipped 2 of 22 listed images") as record:
        dm.setup("fit")
    assert sum("skipped" in str(w.message) for w in record) == 1
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (16, 2, 2)
    every = sorted(dm.train_set.indices + dm.val_set.indices + dm.test_set.indices)
    assert every == list(range(20))
    batch = next(iter(dm.val_dataloader()))
    assert batch["input_ids"].shape == batch["mask"].shape == (2, 1024)
    assert batch["mask"].all()  # black pixels (id 0) attended: no padding in images
    for row, index in enumerate(dm.val_set.indices):
        (pixels,), label = dm.val_set.dataset[index]
        assert batch["input_ids"][row].tolist() == pixels.tolist()
        assert batch["label"][row] == label
    # metadata order: 0.npy then 1.npy; sample i has label i % 2 and a row of value 255 - i
    (pixels,), label = dm.val_set.dataset[0]
    assert label == 0 and pixels.reshape(32, 32)[0].tolist() == [255] * 32 and pixels.sum() == 255 * 32


def test_pathfinder_bad_metadata(tmp_path):
    root = write_pathfinder(tmp_path)
    meta = root / "pathfinder32" / "curv_contour_length_14" / "metadata" / "1.npy"
    meta.write_text("imgs/1 sample_1.png 1 1\nimgs/1 sample_3.png 3\n")
    with pytest.raises(ValueError, match=r"1\.npy:2: expected '<folder> <file> <index> <label>"):
        PathfinderDataModule(root=str(root)).setup()
    meta.write_text("imgs/1 sample_1.png 1 7\n")
    with pytest.raises(ValueError, match=r"1\.npy:1: label '7' is not a class in 0\.\.1"):
        PathfinderDataModule(root=str(root)).setup()
    with pytest.raises(FileNotFoundError, match=r"no metadata files .*pathfinder64.*expected layout"):
        PathfinderDataModule(root=str(root), resolution=64).setup()
