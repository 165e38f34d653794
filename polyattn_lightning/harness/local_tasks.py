"""The local lm-evaluation-harness tasks ``polyattn eval`` writes, read from files (no download): held-out text for
perplexity and a multiple-choice set generated from it.

* :data:`PERPLEXITY` (``polyattn_heldout``): each line of a held-out text file is one document, scored with
  ``loglikelihood_rolling``: lm-eval's ``word_perplexity`` (per whitespace word), ``byte_perplexity`` and
  ``bits_per_byte``.
* :data:`CHOICE` (``polyattn_sums``): the tiny Llama quickstart's generated stories
  (:func:`~polyattn_lightning.data.generated_text.story`) cut before the sum they end with; the choices are the
  right sum and three other sums (seeded), ``multiple_choice``: ``acc`` (chance 0.25) and ``acc_norm``.

:func:`write_tasks` writes both tasks' YAML and JSONL files into one folder, lm-eval's ``include_path``.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import yaml

from ..errors import DataError, MissingPathError

#: The perplexity task: each held-out line scored with ``loglikelihood_rolling``.
PERPLEXITY = "polyattn_heldout"
#: The multiple-choice task: the sum a story ends with, among four.
CHOICE = "polyattn_sums"
#: The tasks ``polyattn eval`` writes and runs by default.
LOCAL_TASKS = (PERPLEXITY, CHOICE)
#: How many choices an item offers (the right sum first drawn, then shuffled).
CHOICES = 4
#: The perplexity task's metrics and lm-eval's aggregation of each.
PERPLEXITY_METRICS = {
    "word_perplexity": "weighted_perplexity",
    "byte_perplexity": "weighted_perplexity",
    "bits_per_byte": "bits_per_byte",
}
#: Other sums offered beside the right one, from this range (two counts of 1..9).
SUMS = range(2, 19)
#: A story's sum: ``... now alice has`` / ``... together alice and bob have``, the sum, then the rest.
SUM = re.compile(r"^(?P<context>.* (?:now \w+ has|have)) (?P<sum>\d+) (?P<rest>.+)$")


def text_lines(path: Path) -> list[str]:
    """The non-empty lines of a held-out text file."""
    if not path.is_file():
        raise MissingPathError(f"--text {path} does not exist: expected a text file, one held-out document a line")
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        raise DataError(f"--text {path} holds no text")
    return lines


def choice_items(stories: list[str], seed: int = 0) -> list[dict]:
    """A multiple-choice item per story that ends with a sum: the story before it, the right continuation and
    three with other sums, in a seeded order."""
    rng, items = random.Random(seed), []
    for story in stories:
        match = SUM.match(story)
        if match is None:
            continue
        right = int(match["sum"])
        sums = [right, *rng.sample([s for s in SUMS if s != right], CHOICES - 1)]
        rng.shuffle(sums)
        items.append({
            "context": match["context"],
            "choices": [f"{s} {match['rest']}" for s in sums],
            "label": sums.index(right),
        })  # fmt: skip
    return items


def task_config(name: str, data: Path, **spec) -> dict:
    """A task lm-eval reads from one local JSONL file (``datasets``' json builder: nothing is downloaded)."""
    return {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data.resolve())}},
        "test_split": "test",
        **spec,
    }


def write_tasks(folder: Path, text: Path, tasks: list[str], seed: int = 0) -> dict[str, int]:
    """The local ``tasks``' YAML and data in ``folder`` (made if needed), from the held-out ``text``; the number of
    documents of each."""
    lines = text_lines(text)
    items = choice_items(lines, seed) if CHOICE in tasks else []
    if CHOICE in tasks and not items:
        raise DataError(
            f"--text {text}: no line ends with a story's sum (the {CHOICE} task needs the generated stories' text); "
            f"leave {CHOICE} out of --tasks"
        )
    folder.mkdir(parents=True, exist_ok=True)
    files = {PERPLEXITY: [{"text": line} for line in lines], CHOICE: items}
    files = {name: rows for name, rows in files.items() if name in tasks}
    for name, rows in files.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    perplexity = task_config(
        PERPLEXITY, folder / f"{PERPLEXITY}.jsonl",
        output_type="loglikelihood_rolling", doc_to_text="", doc_to_target="{{text}}",
        metric_list=[
            {"metric": m, "aggregation": aggregation, "higher_is_better": False}
            for m, aggregation in PERPLEXITY_METRICS.items()
        ],
        metadata={"version": 1.0, "source": str(text)},
    )  # fmt: skip
    choice = task_config(
        CHOICE, folder / f"{CHOICE}.jsonl",
        output_type="multiple_choice", doc_to_text="{{context}}", doc_to_choice="{{choices}}",
        doc_to_target="{{label}}",
        metric_list=[{"metric": m, "aggregation": "mean", "higher_is_better": True} for m in ("acc", "acc_norm")],
        metadata={"version": 1.0, "source": str(text), "seed": seed},
    )  # fmt: skip
    for config in (perplexity, choice):
        if config["task"] in files:
            (folder / f"{config['task']}.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return {name: len(rows) for name, rows in files.items()}
