"""ListOps: LRA's tokeniser, the generator (its expressions evaluate to their Target), the TSV reader, bad input."""
from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import torch

from polyattn_lightning.data.lra.__main__ import main as lra_main
from polyattn_lightning.data.lra.listops import (
    VOCAB_SIZE,
    ListOpsDataModule,
    ListOpsSpec,
    default_root,
    evaluate,
    generate,
    tokenize,
)
from polyattn_lightning.data.generated import cache_root, staged_dir
from polyattn_lightning.errors import ConfigError, DataError, MissingPathError

SMALL = ListOpsSpec(num_train=60, num_val=10, num_test=10, min_length=10, max_length=80, max_depth=4, max_args=5, seed=1)


def write_release_tsv(path: Path, rows: list[tuple[str, str]], header=("Source", "Target")) -> Path:
    """A file as LRA's generator writes it: csv.writer with tabs, header row, CRLF line ends."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, delimiter="\t")
        writer.writerow(header)
        writer.writerows(rows)
    return path


def release(root: Path, rows=None) -> Path:
    rows = rows or [("( ( ( [MAX 2 ) 9 ) ] )", "9"), ("( ( ( ( [SM 9 ) 8 ) ( ( [MIN 1 ) 0 ) ] ) ] )", "7")]
    for split in ("train", "val", "test"):
        write_release_tsv(root / "listops-1000" / f"basic_{split}.tsv", rows)
    return root


def test_tokenizer_drops_brackets_like_lra():
    # LRA's tfds Tokenizer keeps alphanumeric runs only: 0-9 -> 1-10, MAX 11, MED 12, MIN 13, SM 14, unknown 15
    assert tokenize("( ( [MAX 2 ) ( [MIN 4 7 ] ) 0 ] )").tolist() == [11, 3, 13, 5, 8, 1]
    assert tokenize("[MED 9 ] [SM foo").tolist() == [12, 10, 14, 15]
    assert VOCAB_SIZE == 16


@pytest.mark.parametrize(
    "source, value",
    [
        ("7", 7),
        ("( ( ( [MAX 2 ) 9 ) ] )", 9),
        ("( ( ( [MED 1 ) 2 ) ] )", 1),  # median 1.5, truncated as LRA's int(np.median)
        ("( ( ( ( [SM 9 ) 8 ) ( ( ( [MIN 3 ) 1 ) ] ) ) ] )", 8),  # (9 + 8 + 1) % 10
    ],
)
def test_evaluate(source, value):
    assert evaluate(source) == value


@pytest.mark.parametrize("source", ["( ( [MAX 2 ) 9 )", "] 3", "[MAX 1 ] 2", "[FOO 1 ]"])
def test_evaluate_rejects_malformed(source):
    with pytest.raises(ValueError):
        evaluate(source)


def test_generated_expressions_evaluate_to_target(tmp_path):
    lra_main(["listops", "--out", str(tmp_path / "gen"), *_spec_args(SMALL)])
    seen = set()
    for split, n in (("train", 60), ("val", 10), ("test", 10)):
        with open(tmp_path / "gen" / "listops-1000" / f"basic_{split}.tsv", newline="") as f:
            rows = list(csv.reader(f, delimiter="\t"))
        assert rows[0] == ["Source", "Target"] and len(rows) == n + 1
        for source, target in rows[1:]:
            assert evaluate(source) == int(target)
            operators = sum(w.startswith("[") for w in source.split())
            assert 10 < len(tokenize(source)) + operators < 80  # LRA's length: values, operators, closing brackets
            assert _depth(source) <= SMALL.max_depth
            seen.add(source)
    assert len(seen) == 80  # distinct across splits
    assert generate(SMALL) == generate(SMALL)
    assert generate(SMALL)["train"] != generate(ListOpsSpec(**{**SMALL.__dict__, "seed": 2}))["train"]


def _depth(source: str) -> int:
    """Tree depth as LRA counts it: the root operator is 1, values one below their operator."""
    depth = deepest = 0
    for word in source.split():
        if word.startswith("["):
            depth += 1
        elif word == "]":
            depth -= 1
        elif word.isdigit():
            deepest = max(deepest, depth + 1)
    return deepest


def _spec_args(spec: ListOpsSpec) -> list[str]:
    return [a for k, v in spec.__dict__.items() for a in (f"--{k.replace('_', '-')}", str(v))]


def test_datamodule_reads_release_format(tmp_path):
    dm = ListOpsDataModule(root=str(release(tmp_path)), batch_size=2)
    dm.setup("fit")
    assert (dm.vocab_size, dm.num_classes, dm.max_length, dm.two_tower) == (16, 10, 2000, False)
    batch = next(iter(dm.train_dataloader()))
    order = batch["label"].tolist()
    assert sorted(order) == [7, 9]
    assert batch["input_ids"].shape == (2, 64) and batch["input_ids"].dtype == torch.long
    expected = {9: [11, 3, 10], 7: [14, 10, 9, 13, 2, 1]}
    for row, label in enumerate(order):
        n = len(expected[label])
        assert batch["input_ids"][row, :n].tolist() == expected[label]
        assert batch["mask"][row].tolist() == [True] * n + [False] * (64 - n)
        assert (batch["input_ids"][row, n:] == 0).all()


def test_long_sequences_truncated_with_one_warning(tmp_path):
    root = release(tmp_path, rows=[("[SM " + "1 " * 30 + "]", "0"), ("[MAX 1 2 ]", "2"), ("[MIN " + "3 " * 9 + "]", "3")])
    dm = ListOpsDataModule(root=str(root), max_length=8)
    with pytest.warns(UserWarning) as record:
        dm.setup()
    for split in ("train", "val", "test"):  # one warning per file
        assert [str(w.message).split("listops-1000/")[1] for w in record if f"basic_{split}" in str(w.message)] == [
            f"basic_{split}.tsv: 2 of 3 sequences are longer than 8 tokens; truncated"
        ]
    assert dm.train_set.towers[0].lengths().tolist() == [8, 3, 8]


@pytest.mark.parametrize(
    "row, message",
    [
        (("[MAX 1 2 ]", "2", "extra"), r"basic_train\.tsv:3: expected 2 tab-separated columns"),
        (("[MAX 1 2 ]",), r"basic_train\.tsv:3: expected 2"),
        (("[MAX 1 2 ]", "10"), r"basic_train\.tsv:3: label '10' is not a class in 0\.\.9"),
        (("[MAX 1 2 ]", "x"), r"basic_train\.tsv:3: label 'x'"),
        (("( )", "1"), r"basic_train\.tsv:3: Source '\( \)' has no tokens"),
    ],
)
def test_malformed_row_names_file_and_line(tmp_path, row, message):
    root = release(tmp_path)
    write_release_tsv(root / "listops-1000" / "basic_train.tsv", [("[MIN 1 2 ]", "1"), row])
    with pytest.raises(DataError, match=message):
        ListOpsDataModule(root=str(root)).setup()


def test_missing_header_and_missing_files(tmp_path):
    root = release(tmp_path)
    (root / "listops-1000" / "basic_val.tsv").write_text("[MAX 1 2 ]\t2\n")
    with pytest.raises(DataError, match=r"basic_val\.tsv:1: expected a header row"):
        ListOpsDataModule(root=str(root)).setup()
    (root / "listops-1000" / "basic_test.tsv").unlink()
    with pytest.raises(MissingPathError, match=r"missing .*basic_test\.tsv; expected layout"):
        ListOpsDataModule(root=str(root)).load(root)
    with pytest.raises(MissingPathError, match=r"data root .*nowhere does not exist; expected layout"):
        ListOpsDataModule(root=str(tmp_path / "nowhere"), generate=SMALL).setup()
    with pytest.raises(ConfigError, match="needs --data.root"):
        ListOpsDataModule().setup()


def test_generates_on_first_use_into_default_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    dm = ListOpsDataModule(generate=SMALL, batch_size=4)
    dm.prepare_data()
    train_file = default_root(SMALL) / "listops-1000" / "basic_train.tsv"
    assert train_file.is_relative_to(tmp_path / "cache") and train_file.is_file()
    stamp = train_file.stat().st_mtime_ns
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (60, 10, 10)
    again = ListOpsDataModule(generate=SMALL)
    again.setup("fit")  # reuses the folder
    assert train_file.stat().st_mtime_ns == stamp
    assert np.array_equal(again.train_set.labels, dm.train_set.labels)


def test_staged_dir_writes_whole_folders_only(tmp_path, monkeypatch):
    root = tmp_path / "set"
    with pytest.raises(RuntimeError):
        with staged_dir(root) as staging:
            (staging / "half.tsv").write_text("x")
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []  # neither the set nor the staging folder
    with staged_dir(root) as staging:
        (staging / "a.tsv").write_text("first")
    with staged_dir(root) as staging:  # another process finished first: its copy stays
        (staging / "a.tsv").write_text("second")
    assert (root / "a.tsv").read_text() == "first"
    with staged_dir(root, replace=True) as staging:  # regenerated for other settings
        (staging / "b.tsv").write_text("new")
    assert [p.name for p in root.iterdir()] == ["b.tsv"] and [p.name for p in tmp_path.iterdir()] == ["set"]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    expected = tmp_path / "cache" / "polyattn_lightning" / "lra" / SMALL.tag()
    assert default_root(SMALL) == cache_root("lra", SMALL.tag()) == expected
