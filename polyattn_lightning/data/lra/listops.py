"""ListOps: the LRA release's TSV files, LRA's tokeniser, and a generator with LRA's grammar.

Tokeniser: that of google-research/long-range-arena ``lra_benchmarks/listops/input_pipeline.py``
(the pipeline Nystromformer's PyTorch numbers come from), which encodes ``Source``
with ``tfds.deprecated.text.TokenTextEncoder`` over a vocabulary built with
``tfds.deprecated.text.Tokenizer()``. That tokeniser keeps only alphanumeric runs
(it splits on the regex ``\\W+``), so ``(``, ``)``, ``[`` and ``]`` are dropped:
``[MAX 2 [MIN 4 7 ] 0 ]`` becomes ``MAX 2 MIN 4 7 0``. The closing brackets are
gone, so a sequence does not determine its expression; that is part of the
benchmark as published (S4 and others keep the brackets and get other numbers).
Ids: 0 padding, 1-14 the tokens ``0``-``9``, ``MAX``, ``MED``, ``MIN``, ``SM``, 15 the
encoder's out-of-vocabulary id; vocabulary size 16 (``TokenTextEncoder.vocab_size``).
The release numbers its 14 tokens in Python ``set`` order, which changes with
``PYTHONHASHSEED``, so it has no fixed numbering to copy; this one is sorted.

Generator: ``lra_benchmarks/data/listops.py``'s grammar and distribution (operators
MAX, MIN, MED, SM = sum mod 10; an operator with probability 0.25 above the
maximum depth, 2 to ``max_args`` arguments; lengths strictly between
``min_length`` and ``max_length`` as that script counts them: operators, values
and closing brackets), the same random draws in the same order from a seeded
``random.Random``, duplicates dropped, written in the release's TSV format::

    python -m polyattn_lightning.data.lra listops --out data/lra      # LRA's sizes: 96k/2k/2k, lengths 500-2000
    python -m polyattn_lightning.data.lra listops --out data/small --num-train 2000 --num-val 200 \\
        --num-test 200 --min-length 50 --max-length 300 --max-depth 4 --seed 0

Either folder is then a ``--data.root`` (it holds ``listops-1000/basic_{train,val,test}.tsv``).
"""

from __future__ import annotations

import csv
import random
import re
from dataclasses import dataclass
from pathlib import Path
from statistics import median

import numpy as np

from ...checkpoint import checkpoint_safe
from ...errors import DataError
from ...waits import Wait
from ..generated import cache_root, staged_dir
from .base import LRADataModule, SequenceBuilder, TokenDataset, parse_label

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")  # LRA's list order; random.choice draws from it
VALUE_P = 0.25  # LRA's VALUE_P: probability that a node above the maximum depth is a value
TOKENS = tuple(str(v) for v in range(10)) + ("MAX", "MED", "MIN", "SM")
TOKEN_IDS = {token: i + 1 for i, token in enumerate(TOKENS)}  # 0 is padding
UNKNOWN_ID = len(TOKENS) + 1
VOCAB_SIZE = len(TOKENS) + 2
_NON_ALPHANUMERIC = re.compile(r"\W+")  # tfds Tokenizer(alphanum_only=True)
SPLITS = ("train", "val", "test")


def tokenize(source: str) -> np.ndarray:
    """LRA's ListOps ids for a ``Source`` string (brackets dropped, unknown words -> 15)."""
    words = [w for w in _NON_ALPHANUMERIC.split(source) if w]
    return np.array([TOKEN_IDS.get(w, UNKNOWN_ID) for w in words], dtype=np.uint8)


def _apply(op: str, args: list[int]) -> int:
    if op == "[MIN":
        return min(args)
    if op == "[MAX":
        return max(args)
    if op == "[MED":
        return int(median(args))  # LRA: int(np.median(...)), the mean of the middle two truncated
    if op == "[SM":
        return sum(args) % 10
    raise ValueError(f"unknown ListOps operator {op!r}")


def evaluate(source: str) -> int:
    """The value of a ListOps expression in the release's text form, e.g. ``( ( [MAX 2 ) 9 ) ] )`` -> 9.

    Parsed from the text (parentheses ignored, ``[OP`` opens and ``]`` closes an
    operator), independently of how the generator computes its targets.
    """
    stack: list[tuple[str, list[int]]] = []
    result: int | None = None
    for word in source.split():
        if word in ("(", ")"):
            continue
        if word in OPERATORS:
            stack.append((word, []))
            continue
        if word == "]":
            if not stack:
                raise ValueError(f"unbalanced ']' in {source!r}")
            op, args = stack.pop()
            value = _apply(op, args)
        elif word.isdigit():
            value = int(word)
        else:
            raise ValueError(f"unexpected token {word!r} in {source!r}")
        if stack:
            stack[-1][1].append(value)
        elif result is None:
            result = value
        else:
            raise ValueError(f"more than one expression in {source!r}")
    if stack or result is None:
        raise ValueError(f"incomplete expression {source!r}")
    return result


@checkpoint_safe
@dataclass(frozen=True)
class ListOpsSpec:
    """What :func:`generate` makes; the defaults are LRA's release (``lra_benchmarks/data/listops.py``)."""

    num_train: int = 96000
    num_val: int = 2000
    num_test: int = 2000
    min_length: int = 500  # exclusive, as LRA's `length > min_length`
    max_length: int = 2000  # exclusive
    max_depth: int = 10  # the root is depth 1; nodes at max_depth are values
    max_args: int = 10
    seed: int = 0

    def tag(self) -> str:
        """A folder name that says what was generated."""
        return (
            f"listops-n{self.num_train}-{self.num_val}-{self.num_test}_len{self.min_length}-{self.max_length}"
            f"_depth{self.max_depth}_args{self.max_args}_seed{self.seed}"
        )


def _tree(rng: random.Random, depth: int, spec: ListOpsSpec) -> tuple[str, int, int]:
    """LRA's ``generate_tree`` and ``to_string``: ``(text, value, length)``, the same draws in the same order."""
    if (rng.random() if depth < spec.max_depth else 1) > VALUE_P:
        value = rng.choice(range(10))
        return str(value), value, 1
    children = [_tree(rng, depth + 1, spec) for _ in range(rng.randint(2, spec.max_args))]
    op = rng.choice(OPERATORS)
    # LRA nests pairs: ((((op, a), b), c), END), each pair printed as "( left right )"
    text = f"( {op} {children[0][0]} )"
    for child_text, _, _ in children[1:]:
        text = f"( {text} {child_text} )"
    text = f"( {text} ] )"
    return text, _apply(op, [value for _, value, _ in children]), 2 + sum(length for _, _, length in children)


def generate(spec: ListOpsSpec, wait: Wait | None = None) -> dict[str, list[tuple[str, int]]]:
    """Distinct expressions with their values, split into train/val/test in the order drawn; each new one counted
    on ``wait``."""
    rng = random.Random(spec.seed)
    total = spec.num_train + spec.num_val + spec.num_test
    samples: dict[str, int] = {}
    while len(samples) < total:
        text, value, length = _tree(rng, 1, spec)
        if spec.min_length < length < spec.max_length and text not in samples:
            samples[text] = value
            if wait is not None:
                wait.add()
    rows = list(samples.items())
    ends = np.cumsum([spec.num_train, spec.num_val, spec.num_test])
    return {
        split: rows[end - n : end] for split, n, end in zip(SPLITS, (spec.num_train, spec.num_val, spec.num_test), ends)
    }


def write_tsv(rows: list[tuple[str, int]], path: Path) -> None:
    """The release's format: ``csv.writer`` with tabs, a ``Source``/``Target`` header (and its CRLF line ends)."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, delimiter="\t")
        writer.writerow(["Source", "Target"])
        writer.writerows(rows)


def write_dataset(spec: ListOpsSpec, root: Path) -> Path:
    """Generate and write ``root/listops-1000/basic_{train,val,test}.tsv``; atomic, so a reader never sees half.
    It says so (:class:`~polyattn_lightning.waits.Wait`): expressions drawn, their rate, the time left, and an
    estimate after the first second where the whole takes more than a minute."""
    total = spec.num_train + spec.num_val + spec.num_test
    wait = Wait(f"drawing {total} ListOps expressions", total=total, unit="expressions")
    with staged_dir(root) as staging, wait:  # another process that finished first wrote the same files
        (staging / "listops-1000").mkdir()
        for split, rows in generate(spec, wait).items():
            write_tsv(rows, staging / "listops-1000" / f"basic_{split}.tsv")
    return Path(root)


def default_root(spec: ListOpsSpec) -> Path:
    """Where :class:`ListOpsDataModule` generates data when no root is given."""
    return cache_root("lra", spec.tag())


def read_tsv(path: Path, max_length: int) -> TokenDataset:
    """A ``Source``/``Target`` TSV file as token sequences and labels; bad rows raise naming file and line."""
    sequences, labels = SequenceBuilder(max_length, str(path)), []
    with open(path, newline="") as f:
        reader = csv.reader(f, delimiter="\t")
        header = next(reader, None)
        if header is None or "Source" not in header or "Target" not in header:
            raise DataError(f"{path}:1: expected a header row with columns Source and Target, got {header}")
        source_col, target_col = header.index("Source"), header.index("Target")
        for row in reader:
            where = f"{path}:{reader.line_num}"
            if not row:
                continue
            if len(row) != len(header):
                raise DataError(f"{where}: expected {len(header)} tab-separated columns {header}, got {len(row)}")
            labels.append(parse_label(row[target_col], 10, where))
            tokens = tokenize(row[source_col])
            if len(tokens) == 0:
                raise DataError(f"{where}: Source {row[source_col]!r} has no tokens")
            sequences.append(tokens)
    return TokenDataset([sequences.build()], labels)


class ListOpsDataModule(LRADataModule):
    """ListOps from the LRA release (``--data.root``: the folder holding ``listops-1000/``), 10 classes.

    Without ``root`` and with ``generate``, the set ``generate`` describes is made
    on first use in ``$XDG_CACHE_HOME/polyattn_lightning/lra/<what was generated>``
    (``~/.cache`` without ``XDG_CACHE_HOME``) and reused afterwards. A given
    ``root`` is always read, never generated into.
    """

    vocab_size = VOCAB_SIZE
    num_classes = 10
    layout = "listops-1000/basic_train.tsv, basic_val.tsv, basic_test.tsv (tab-separated, header row Source\\tTarget)"

    def __init__(
        self,
        root: str | None = None,
        generate: ListOpsSpec | None = None,
        max_length: int = 2000,
        fixed_length: bool = False,
        batch_size: int = 32,
        num_workers: int = 0,
        pin_memory: bool = False,
    ):
        """
        Args:
            root: the unpacked LRA release (or a folder the generator wrote).
            generate: the set to generate when ``root`` is not given (the quickstart's).
            max_length: tokens kept per sequence (LRA: 2000).
            fixed_length: pad every batch to ``max_length`` instead of its longest sequence.
        """
        super().__init__(root, max_length, fixed_length, 0, batch_size, num_workers, pin_memory)
        self.generate = generate

    def prepare_data(self) -> None:
        self.data_root()  # generates on one process per node; the others wait, then read it

    def data_root(self) -> Path:
        if self.root is not None or self.generate is None:
            return super().data_root()
        root = default_root(self.generate)
        if not (root / "listops-1000").is_dir():
            write_dataset(self.generate, root)
        return root

    def load(self, root: Path) -> tuple[TokenDataset, TokenDataset, TokenDataset]:
        files = [self.require_file(root / "listops-1000" / f"basic_{split}.tsv") for split in SPLITS]
        return tuple(read_tsv(path, self.max_length) for path in files)
