"""LRA Retrieval: pairs of ACL Anthology Network papers at byte level, for a two-tower model.

The release's ``tsv_data/new_aan_pairs.{train,eval,test}.tsv`` are tab-separated
without a header or quoting (the texts contain quotes): label (``0.0``/``1.0``), id1,
id2, text1, text2. As google-research/long-range-arena ``lra_benchmarks/matching/input_pipeline.py``
with ``tokenizer='char'`` (the Nystromformer setup): ``ByteTextEncoder``, byte b is
id b + 1, 0 is padding (vocabulary 257), each text truncated to ``max_length`` = 4000 bytes.
"""

from __future__ import annotations

from pathlib import Path

from ...errors import DataError
from .base import LRADataModule, SequenceBuilder, TokenDataset, parse_label

SPLITS = ("train", "eval", "test")
COLUMNS = ("label", "id1", "id2", "text1", "text2")


def read_pairs(path: Path, max_length: int) -> TokenDataset:
    """One AAN file as two towers of byte sequences; a bad row raises naming the file and line."""
    towers = [SequenceBuilder(max_length, f"{path} ({column})") for column in COLUMNS[3:]]
    labels = []
    with open(path, "rb") as f:  # bytes: the model reads bytes, and no decoding error can stop the run
        for line_no, line in enumerate(f, 1):
            line = line.rstrip(b"\r\n")
            if not line:
                continue
            fields = line.split(b"\t")
            where = f"{path}:{line_no}"
            if len(fields) != len(COLUMNS):
                raise DataError(f"{where}: expected {len(COLUMNS)} tab-separated columns {COLUMNS}, got {len(fields)}")
            labels.append(parse_label(fields[0].decode("ascii", "replace"), 2, where))
            for tower, column, text in zip(towers, COLUMNS[3:], fields[3:]):
                if not text:
                    raise DataError(f"{where}: {column} is empty")
                tower.append(text)
    return TokenDataset([tower.build() for tower in towers], labels, shift=1)


class AANDataModule(LRADataModule):
    """LRA Retrieval (AAN, 2 classes, two towers); ``--data.root`` is the LRA release folder holding ``tsv_data/``.

    Batches hold ``input_ids`` and ``mask`` of shape ``(B, 2, L)``: both documents
    padded to the same ``L``, each masked by its own length.
    """

    vocab_size = 257
    num_classes = 2
    two_tower = True
    layout = (
        "tsv_data/new_aan_pairs.train.tsv, new_aan_pairs.eval.tsv, new_aan_pairs.test.tsv "
        "(tab-separated, no header: label id1 id2 text1 text2)"
    )

    def __init__(
        self,
        root: str | None = None,
        max_length: int = 4000,
        fixed_length: bool = False,
        batch_size: int = 32,
        num_workers: int = 0,
        pin_memory: bool = False,
    ):
        super().__init__(root, max_length, fixed_length, 0, batch_size, num_workers, pin_memory)

    def load(self, root: Path) -> tuple[TokenDataset, TokenDataset, TokenDataset]:
        files = [self.require_file(root / "tsv_data" / f"new_aan_pairs.{split}.tsv") for split in SPLITS]
        return tuple(read_pairs(path, self.max_length) for path in files)
