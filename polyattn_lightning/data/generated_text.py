"""The HF quickstarts' text sets, generated (seeded) on first use into the cache, then read like user files.

* :class:`NegatedSentimentData`: short reviews labelled ``positive`` / ``negative`` where the label is the
  adjective's polarity flipped by a negation ("the plot was not dull" is positive). Every adjective and the
  negation appear equally often in both classes, so no single token tells the label (majority: 50%).
  ``clauses: 2`` is the harder set: two such clauses joined by a conjunction ("the plot was not dull , but the
  cast was hardly great"), four labels (``positive-negative``...: each clause's polarity, in order), so every
  negation must be bound to its own adjective across the sentence (majority: 25%).
* :class:`GeneratedStoriesData`: sentences from a small grammar (who gives whom how many of what, and the
  sums that follow) for a causal LM, with a byte-level BPE tokenizer trained on the training split with
  ``tokenizers`` and saved as a transformers tokenizer folder.
"""

from __future__ import annotations

import csv
import random
from pathlib import Path

from ..errors import ConfigError
from .generated import cache_root, staged_dir
from .text import CausalLMText, TextClassificationData

SUBJECTS = (
    "the movie",
    "this film",
    "the plot",
    "the acting",
    "the soundtrack",
    "the ending",
    "the cast",
    "the story",
    "the dialogue",
    "the camera work",
    "the script",
    "the sequel",
)
VERBS = ("was", "is", "seemed", "felt", "looked", "sounded")
ADVERBS = ("", "", "really", "quite", "truly", "very", "rather")
OPENERS = ("", "", "honestly ,", "i think", "to be fair ,", "overall ,", "in my view", "sadly ,", "frankly ,")
NEGATIONS = ("not", "never", "hardly")
POSITIVE = ("good", "great", "wonderful", "brilliant", "enjoyable", "superb", "fun", "moving", "clever", "charming")
NEGATIVE = ("bad", "awful", "boring", "dull", "terrible", "weak", "poor", "tedious", "clumsy", "bland")


def negated_review(rng: random.Random) -> tuple[str, str]:
    """One review and its label; the adjective's polarity and the negation are drawn independently."""
    positive, negated = rng.random() < 0.5, rng.random() < 0.5
    words = [rng.choice(OPENERS), rng.choice(SUBJECTS), rng.choice(VERBS)]
    words += [
        rng.choice(NEGATIONS) if negated else "",
        rng.choice(ADVERBS),
        rng.choice(POSITIVE if positive else NEGATIVE),
    ]
    return " ".join(w for w in words if w), "positive" if positive != negated else "negative"


CONJUNCTIONS = (", but", ", and", "; yet", ", while", ", whereas")


def two_clause_review(rng: random.Random) -> tuple[str, str]:
    """Two negated reviews in one sentence; the label names each clause's polarity, first then second."""
    (first, first_label), (second, second_label) = negated_review(rng), negated_review(rng)
    return f"{first} {rng.choice(CONJUNCTIONS)} {second}", f"{first_label}-{second_label}"


def _write_splits(root: Path, sizes: dict[str, int], seed: int, make) -> None:
    """Distinct samples (no test sentence is a training one), split in the given sizes, one file per split."""
    rng, seen, samples = random.Random(seed), set(), []
    total = sum(sizes.values())
    for _ in range(200 * total):
        sample = make(rng)
        if sample[0] not in seen:
            seen.add(sample[0])
            samples.append(sample)
        if len(samples) == total:
            break
    with staged_dir(root) as staging:
        start = 0
        for split, size in sizes.items():
            yield staging, split, samples[start : start + size]
            start += size


class NegatedSentimentData(TextClassificationData):
    """The classification quickstart's set (written under ``root`` on first use); see the module docstring."""

    def __init__(
        self,
        tokenizer: str | None = None,
        root: str | None = None,
        train_size: int = 800,
        val_size: int = 200,
        test_size: int = 200,
        seed: int = 0,
        clauses: int = 1,
        max_length: int = 32,
        batch_size: int = 16,
        num_workers: int = 0,
        pin_memory: bool = False,
    ):
        """``root``: where the CSV files go (default: the cache, one folder per size, seed and clause count);
        ``clauses``: 1 (two labels) or 2 (four labels, see the module docstring)."""
        if clauses not in (1, 2):
            raise ConfigError(f"data.clauses: expected 1 or 2 (clauses per review), got {clauses!r}")
        super().__init__(
            tokenizer=tokenizer,
            max_length=max_length,
            batch_size=batch_size,
            num_workers=num_workers,
            pin_memory=pin_memory,
        )
        self.sizes = {"train": train_size, "val": val_size, "test": test_size}
        self.seed, self.review = seed, negated_review if clauses == 1 else two_clause_review
        tag = f"seed{seed}-{train_size}-{val_size}-{test_size}" + ("" if clauses == 1 else f"-clauses{clauses}")
        self.root = Path(root) if root else cache_root("negated_sentiment", tag)

    def files(self) -> dict[str, str]:
        return {split: str(self.root / f"{split}.csv") for split in self.sizes}

    def prepare_data(self) -> None:
        if (self.root / "test.csv").is_file():
            return
        for folder, split, rows in _write_splits(self.root, self.sizes, self.seed, self.review):
            with (folder / f"{split}.csv").open("w", newline="", encoding="utf-8") as file:
                writer = csv.writer(file)
                writer.writerow(["text", "label"])
                writer.writerows(rows)


NAMES = ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi")
THINGS = ("apples", "books", "coins", "shells", "stamps", "cards", "marbles", "pens")
PLACES = ("the market", "the park", "school", "the library", "the beach", "the station")


def story(rng: random.Random) -> tuple[str]:
    """Two people, what each has and gets, and the sum (the numbers must be carried across the sentence)."""
    a, b = rng.sample(NAMES, 2)
    thing, place = rng.choice(THINGS), rng.choice(PLACES)
    x, y = rng.randint(1, 9), rng.randint(1, 9)
    if rng.random() < 0.5:
        text = f"{a} went to {place} with {x} {thing} . {b} gave {a} {y} more {thing} . now {a} has {x + y} {thing} ."
    else:
        text = f"{a} has {x} {thing} and {b} has {y} {thing} . together {a} and {b} have {x + y} {thing} at {place} ."
    return (text,)


class GeneratedStoriesData(CausalLMText):
    """The causal-LM quickstart's text and tokenizer (written under ``root`` on first use)."""

    def __init__(
        self,
        root: str | None = None,
        train_size: int = 3000,
        val_size: int = 300,
        test_size: int = 300,
        seed: int = 0,
        vocab: int = 384,
        block_size: int = 64,
        batch_size: int = 16,
        num_workers: int = 0,
        pin_memory: bool = False,
    ):
        """``vocab``: the size of the byte-level BPE vocabulary trained on the training split."""
        self.root = Path(root) if root else cache_root("generated_stories", f"seed{seed}-{train_size}-v{vocab}")
        super().__init__(
            tokenizer=str(self.root / "tokenizer"),
            block_size=block_size,
            batch_size=batch_size,
            num_workers=num_workers,
            pin_memory=pin_memory,
        )
        self.sizes = {"train": train_size, "val": val_size, "test": test_size}
        self.seed, self.vocab = seed, vocab

    def files(self) -> dict[str, str]:
        return {split: str(self.root / f"{split}.txt") for split in self.sizes}

    def prepare_data(self) -> None:
        if (self.root / "tokenizer" / "tokenizer.json").is_file():
            return
        for folder, split, rows in _write_splits(self.root, self.sizes, self.seed, story):
            (folder / f"{split}.txt").write_text("".join(text + "\n" for (text,) in rows), encoding="utf-8")
            if split == "train":
                train_tokenizer([text for (text,) in rows], self.vocab).save_pretrained(folder / "tokenizer")


def train_tokenizer(texts: list[str], vocab: int):
    """A byte-level BPE tokenizer (``tokenizers``) with ``<pad>`` and ``<eos>``, as a transformers tokenizer."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        texts, vocab_size=vocab, min_frequency=2, special_tokens=["<pad>", "<eos>"], show_progress=False
    )
    return PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="<eos>")


__all__ = ["GeneratedStoriesData", "NegatedSentimentData", "negated_review", "story", "train_tokenizer"]
