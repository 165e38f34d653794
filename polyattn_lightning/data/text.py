"""Text for Hugging Face models: labelled rows (CSV / JSONL) for classification, plain text for causal LMs.

Read by the project (``csv``, ``json``), so a malformed row is an error naming its file and line, and
tokenised with the model's own tokenizer (a folder, see :mod:`~polyattn_lightning.models.hf_pretrained`).

* Labelled rows: columns ``text``, optional ``text_pair`` and ``label``. Labels are strings or ints; the
  classes are the training labels in sorted order (numerically when every label is an integer), exposed as
  ``classes`` (the task saves them with its checkpoint) and ``num_classes``. Rows longer than ``max_length``
  tokens are truncated with one warning that counts them (``too_long: error`` makes them an error).
* Plain text: the file's lines tokenised and joined with the tokenizer's end-of-sequence token into one
  stream, cut into blocks of ``block_size`` tokens (the last, shorter, block is dropped); ``vocab_size``
  is the tokenizer's size.
"""

from __future__ import annotations

import csv
import json
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from ..errors import ConfigError, DataError, MissingPathError
from ..models.hf_pretrained import load_tokenizer
from .base import DataModule

TOO_LONG = ("truncate", "error")


def read_rows(path: str | Path) -> list[tuple[str, str | None, str, int]]:
    """``(text, text_pair or None, label as text, line)`` of every row of a ``.csv`` or ``.jsonl`` file."""
    path = Path(path)
    if not path.is_file():
        raise MissingPathError(f"data file {path} does not exist")
    if path.suffix == ".csv":
        return _csv_rows(path)
    if path.suffix in (".jsonl", ".json"):
        return _jsonl_rows(path)
    raise ConfigError(f"data file {path}: expected a .csv or .jsonl file (columns text, optional text_pair, label)")


def _row(path: Path, line: int, record: dict) -> tuple[str, str | None, str, int]:
    for column in ("text", "label"):
        value = record.get(column)
        if value is None or (isinstance(value, str) and not value.strip()):
            raise DataError(f"{path}:{line}: no {column!r} value (expected columns text, optional text_pair, label)")
    if not isinstance(record["text"], str) or not isinstance(record.get("text_pair") or "", str):
        raise DataError(f"{path}:{line}: text and text_pair must be strings")
    if isinstance(record["label"], (bool, float, dict, list)):
        raise DataError(f"{path}:{line}: label {record['label']!r} must be a string or an integer")
    return record["text"], record.get("text_pair") or None, str(record["label"]).strip(), line


def _csv_rows(path: Path) -> list[tuple[str, str | None, str, int]]:
    with path.open(newline="", encoding="utf-8") as file:
        reader = csv.reader(file)
        header = next(reader, None)
        if header is None or "text" not in header or "label" not in header:
            raise DataError(f"{path}:1: the header must name columns text and label (optional text_pair), got {header}")
        rows = []
        for fields in reader:
            if not fields:
                continue
            if len(fields) != len(header):
                raise DataError(f"{path}:{reader.line_num}: {len(fields)} fields, the header has {len(header)}")
            rows.append(_row(path, reader.line_num, dict(zip(header, fields))))
    return rows


def _jsonl_rows(path: Path) -> list[tuple[str, str | None, str, int]]:
    rows = []
    with path.open(encoding="utf-8") as file:
        for line, text in enumerate(file, 1):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{line}: not a JSON object ({err.msg})") from None
            if not isinstance(record, dict):
                raise DataError(
                    f"{path}:{line}: expected a JSON object with text and label, got {type(record).__name__}"
                )
            rows.append(_row(path, line, record))
    return rows


def sorted_classes(labels: list[str]) -> list[str]:
    """The distinct labels in sorted order: numerically when all are integers, else as strings."""
    distinct = set(labels)
    try:
        return sorted(distinct, key=int)
    except ValueError:
        return sorted(distinct)


class Encoded(Dataset):
    """Tokenised rows: dicts of ``input_ids`` (and ``attention_mask``, ``token_type_ids``, ``labels``)."""

    def __init__(self, items: list[dict[str, Any]]):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.items[index]

    @property
    def labels(self) -> list[int] | None:
        """Every row's class index (labelled rows), or None (blocks of a causal LM's text have none)."""
        return [item["labels"] for item in self.items] if self.items and "labels" in self.items[0] else None


class TextData(DataModule):
    """What both text DataModules share: split files read with the model's tokenizer, set up once, the last short
    training batch kept. A subclass reads the files into data sets (:meth:`read`); a generated set writes its files
    in ``prepare_data`` and names them in :meth:`files`."""

    drop_last_train = False

    def __init__(
        self,
        train: str | None,
        val: str | None,
        tokenizer: str | None,
        test: str | None,
        batch_size: int,
        num_workers: int,
        pin_memory: bool,
    ):
        super().__init__(batch_size, num_workers, pin_memory)
        self.train, self.val, self.test, self.tokenizer_path = train, val, test, tokenizer

    def files(self) -> dict[str, str | None]:
        """The split files by split name (``test`` may be None)."""
        return {"train": self.train, "val": self.val, "test": self.test}

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        self.prepare_data()  # a generated set writes its files (also when used without a Trainer)
        files = self.files()
        for key, value in (("train", files["train"]), ("val", files["val"]), ("tokenizer", self.tokenizer_path)):
            if value is None:
                raise ConfigError(f"data.{key} is required")
        self.tokenizer = load_tokenizer(self.tokenizer_path, "data.tokenizer")
        sets = self.read({split: Path(path) for split, path in files.items() if path is not None})
        self.train_set, self.val_set, self.test_set = sets["train"], sets["val"], sets.get("test")

    def read(self, files: dict[str, Path]) -> dict[str, Encoded]:
        """The data set of each split file given (``self.tokenizer`` is loaded)."""
        raise NotImplementedError


class TextClassificationData(TextData):
    """Labelled text from CSV / JSONL files; batches are the tokenizer's padded dicts plus ``labels``."""

    sample_noun = "rows"

    def __init__(
        self,
        train: str | None = None,
        val: str | None = None,
        tokenizer: str | None = None,
        test: str | None = None,
        max_length: int = 128,
        too_long: str = "truncate",
        batch_size: int = 16,
        num_workers: int = 0,
        pin_memory: bool = False,
    ):
        """
        Args:
            train, val, test: ``.csv`` / ``.jsonl`` files (test: optional; validation is tested without it).
            tokenizer: the model's tokenizer folder, or ``package:<name>`` (see ``models/hf_pretrained.py``).
            max_length: most tokens per row (the pair counts together); the task checks it against the model's
                ``max_position_embeddings``.
            too_long: ``truncate`` (one warning counts the rows cut) or ``error`` (the first row too long fails).
        """
        super().__init__(train, val, tokenizer, test, batch_size, num_workers, pin_memory)
        if too_long not in TOO_LONG:
            raise ConfigError(f"data.too_long must be one of {TOO_LONG}, got {too_long!r}")
        self.max_length, self.too_long = max_length, too_long
        self.classes: list[str] | None = None
        self.num_classes: int | None = None

    def read(self, files: dict[str, Path]) -> dict[str, Encoded]:
        rows = {split: read_rows(path) for split, path in files.items()}
        self.classes = sorted_classes([label for *_, label, _ in rows["train"]])
        self.num_classes = len(self.classes)
        if self.num_classes < 2:
            raise DataError(f"{files['train']}: one label only ({self.classes[0]!r}); classification needs two or more")
        index = {label: i for i, label in enumerate(self.classes)}
        encoded, truncated = {}, 0
        for split, split_rows in rows.items():
            encoded[split], cut = self._encode(files[split], split_rows, index)
            truncated += cut
        if truncated:
            warnings.warn(
                f"{truncated} rows longer than data.max_length={self.max_length} tokens were truncated "
                "(data.too_long: error refuses them)",
                stacklevel=3,
            )
        from transformers import DataCollatorWithPadding

        self.collate_fn = DataCollatorWithPadding(self.tokenizer, return_tensors="pt")
        return encoded

    def _encode(self, path: Path, rows, index: dict[str, int]) -> tuple[Encoded, int]:
        texts, pairs = [r[0] for r in rows], [r[1] for r in rows]
        has_pairs = any(p is not None for p in pairs)
        if has_pairs and not all(p is not None for p in pairs):
            line = next(r[3] for r in rows if r[1] is None)
            raise DataError(f"{path}:{line}: no text_pair value (other rows of the file have one)")
        full = self.tokenizer(texts, pairs if has_pairs else None)["input_ids"]
        long = [(row[3], len(ids)) for row, ids in zip(rows, full) if len(ids) > self.max_length]
        if long and self.too_long == "error":
            line, length = long[0]
            raise DataError(
                f"{path}:{line}: {length} tokens, more than data.max_length={self.max_length} "
                f"({len(long)} such rows; too_long: truncate cuts them)"
            )
        enc = self.tokenizer(texts, pairs if has_pairs else None, truncation=True, max_length=self.max_length)
        items = []
        for i, (*_, label, line) in enumerate(rows):
            if label not in index:
                raise DataError(f"{path}:{line}: label {label!r} is not among the training labels {self.classes}")
            items.append({**{key: values[i] for key, values in enc.items()}, "labels": index[label]})
        return Encoded(items), len(long)


class CausalLMText(TextData):
    """Plain UTF-8 text files cut into blocks of ``block_size`` tokens; batches are ``input_ids`` ``(B, block)``."""

    def __init__(
        self,
        train: str | None = None,
        val: str | None = None,
        tokenizer: str | None = None,
        test: str | None = None,
        block_size: int = 128,
        batch_size: int = 16,
        num_workers: int = 0,
        pin_memory: bool = False,
    ):
        """
        Args:
            train, val, test: plain text files, one document or sentence per line.
            tokenizer: a tokenizer folder (with an end-of-sequence token) or ``package:<name>``.
            block_size: tokens per training sequence; the task checks it against the model's positions.
        """
        super().__init__(train, val, tokenizer, test, batch_size, num_workers, pin_memory)
        self.block_size = block_size
        self.vocab_size: int | None = None

    def read(self, files: dict[str, Path]) -> dict[str, Encoded]:
        if self.tokenizer.eos_token_id is None:
            raise ConfigError(f"data.tokenizer {self.tokenizer_path}: the tokenizer has no end-of-sequence token")
        self.vocab_size = len(self.tokenizer)
        return {split: self._blocks(path) for split, path in files.items()}

    def _blocks(self, path: Path) -> Encoded:
        if not path.is_file():
            raise MissingPathError(f"data file {path} does not exist")
        stream: list[int] = []
        with path.open("rb") as file:
            for line, raw in enumerate(file, 1):
                try:
                    text = raw.decode("utf-8").strip()
                except UnicodeDecodeError as err:
                    raise DataError(f"{path}:{line}: not UTF-8 text ({err.reason} at byte {err.start})") from None
                if text:
                    stream += self.tokenizer(text)["input_ids"] + [self.tokenizer.eos_token_id]
        size = self.block_size
        if len(stream) < size:
            raise DataError(f"{path}: {len(stream)} tokens, fewer than one block of data.block_size={size}")
        ids = torch.tensor(stream[: len(stream) // size * size]).view(-1, size)
        return Encoded([{"input_ids": row} for row in ids])


__all__ = ["CausalLMText", "TextClassificationData", "TextData", "read_rows", "sorted_classes"]
