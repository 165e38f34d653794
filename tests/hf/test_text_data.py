"""Text data for HF models: reading CSV / JSONL / plain text, label order, truncation, and errors by file and line."""
from __future__ import annotations

import json

import pytest
from transformers import BertConfig

from polyattn_lightning.data import generated_text
from polyattn_lightning.data.generated_text import NegatedSentimentData, negated_review, train_tokenizer
from polyattn_lightning.data.text import CausalLMText, TextClassificationData, read_rows, sorted_classes
from polyattn_lightning.errors import ConfigError, DataError, MissingPathError
from polyattn_lightning.models.hf_pretrained import check_tokenizer, model_folder


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    texts = [f"word{i % 7} and word{i % 5} with more words" for i in range(200)]
    train_tokenizer(texts, 300).save_pretrained(folder)
    return folder


def write_csv(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_rows_labels_and_batches(tmp_path, tokenizer_dir):
    train = write_csv(tmp_path / "train.csv", ["text,label", "word1 and word2,10", "word3,2", '"word4, more",2'])
    val = tmp_path / "val.jsonl"
    val.write_text(json.dumps({"text": "word1", "label": 10}) + "\n\n" + json.dumps({"text": "word2", "label": "2"}) + "\n")
    data = TextClassificationData(str(train), str(val), str(tokenizer_dir), batch_size=2)
    data.setup("fit")
    assert data.classes == ["2", "10"] and data.num_classes == 2  # integers sort numerically
    assert [item["labels"] for item in data.train_set.items] == [1, 0, 0]
    batch = data.collate_fn([data.train_set[0], data.train_set[1]])
    assert batch["input_ids"].shape[0] == 2 and batch["attention_mask"][1].sum() < batch["attention_mask"][0].sum()
    assert sorted_classes(["b", "a", "c"]) == ["a", "b", "c"]


def test_the_chance_rate_is_the_validation_rows_majority_label(tmp_path, tokenizer_dir):
    train = write_csv(tmp_path / "train.csv", ["text,label", "a,x", "b,y", "c,z"])
    val = write_csv(tmp_path / "val.csv", ["text,label", "a,y", "b,y", "c,x", "d,y", "e,z"])
    data = TextClassificationData(str(train), str(val), str(tokenizer_dir))
    data.setup("fit")
    chance = data.chance_rate()
    assert (data.classes[chance.label], chance.rate, chance.samples) == ("y", 3 / 5, 5)
    assert chance.source == "majority class of 5 validation rows"
    blocks = CausalLMText(str(val), str(val), str(tokenizer_dir), block_size=2)
    blocks.setup("fit")
    assert blocks.chance_rate() is None  # a language model's text has no classes


@pytest.mark.parametrize("name, lines, message", [
    ("bad.csv", ["text,label", "fine,1", "one,two,three"], r"bad\.csv:3: 3 fields, the header has 2"),
    ("bad.csv", ["text,label", "fine,1", ",1"], r"bad\.csv:3: no 'text' value"),
    ("bad.csv", ["words,label", "fine,1"], r"bad\.csv:1: the header must name columns text and label"),
    ("bad.jsonl", ['{"text": "a", "label": 1}', '{"text": "b", "label": '], r"bad\.jsonl:2: not a JSON object"),
    ("bad.jsonl", ['{"text": "a", "label": 1}', '["b", 1]'], r"bad\.jsonl:2: expected a JSON object"),
    ("bad.jsonl", ['{"text": "a", "label": 1.5}'], r"bad\.jsonl:1: label 1.5 must be a string or an integer"),
])
def test_malformed_rows_are_named_by_file_and_line(tmp_path, name, lines, message):
    with pytest.raises(DataError, match=message):
        read_rows(write_csv(tmp_path / name, lines))


def test_unknown_label_missing_file_and_format(tmp_path, tokenizer_dir):
    train = write_csv(tmp_path / "train.csv", ["text,label", "a,x", "b,y"])
    val = write_csv(tmp_path / "val.csv", ["text,label", "a,x", "b,z"])
    with pytest.raises(DataError, match=r"val\.csv:3: label 'z' is not among the training labels \['x', 'y'\]"):
        TextClassificationData(str(train), str(val), str(tokenizer_dir)).setup()
    with pytest.raises(MissingPathError, match="data file .*nothere.csv does not exist"):
        read_rows(tmp_path / "nothere.csv")
    with pytest.raises(ConfigError, match=r"expected a \.csv or \.jsonl file"):
        read_rows(write_csv(tmp_path / "rows.tsv", ["text\tlabel"]))


def test_long_rows_are_truncated_with_one_counting_warning_or_refused(tmp_path, tokenizer_dir):
    train = write_csv(tmp_path / "train.csv", ["text,label", "word1 " * 40 + ",a", "word2 " * 40 + ",b", "word3,a"])
    data = TextClassificationData(str(train), str(train), str(tokenizer_dir), max_length=8)
    with pytest.warns(UserWarning, match="4 rows longer than data.max_length=8 tokens were truncated"):
        data.setup()
    assert max(len(item["input_ids"]) for item in data.train_set.items) == 8
    strict = TextClassificationData(str(train), str(train), str(tokenizer_dir), max_length=8, too_long="error")
    with pytest.raises(DataError, match=r"train\.csv:2: \d+ tokens, more than data.max_length=8"):
        strict.setup()


def test_plain_text_blocks_and_errors(tmp_path, tokenizer_dir):
    text = tmp_path / "train.txt"
    text.write_text("word1 and word2\n\nword3 with more words\n" * 20)
    data = CausalLMText(str(text), str(text), str(tokenizer_dir), block_size=16)
    data.setup()
    assert data.vocab_size == len(data.tokenizer) > 256 and all(item["input_ids"].shape == (16,) for item in data.train_set.items)
    (tmp_path / "bad.txt").write_bytes(b"fine line\nbad \xff byte\n")
    with pytest.raises(DataError, match=r"bad\.txt:2: not UTF-8"):
        CausalLMText(str(tmp_path / "bad.txt"), str(text), str(tokenizer_dir)).setup()
    with pytest.raises(DataError, match="fewer than one block of data.block_size=4096"):
        CausalLMText(str(text), str(text), str(tokenizer_dir), block_size=4096).setup()


def test_model_folders_and_tokenizer_mismatch(tmp_path, tokenizer_dir):
    with pytest.raises(MissingPathError, match="model: model folder .*missing does not exist"):
        model_folder(tmp_path / "missing")
    with pytest.raises(MissingPathError, match="holds no model: no config.json"):
        model_folder(tokenizer_dir)
    (tmp_path / "cfg").mkdir()
    BertConfig().save_pretrained(tmp_path / "cfg")
    with pytest.raises(MissingPathError, match="holds no model weights"):
        model_folder(tmp_path / "cfg")
    with pytest.raises(MissingPathError, match="package 'no_such_package_xyz' is not installed"):
        model_folder("package:no_such_package_xyz")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    with pytest.raises(ConfigError, match=f"the tokenizer has {len(tokenizer)} tokens but BertModel embeds 64"):
        check_tokenizer(tokenizer, BertConfig(vocab_size=64), "data.tokenizer", "BertModel")


def test_generated_sentiment_needs_more_than_one_token(tmp_path, tokenizer_dir):
    """Every adjective (and the negation) appears in both classes about equally: no single token decides."""
    import random

    rng = random.Random(0)
    reviews = [negated_review(rng) for _ in range(4000)]
    for word in ("good", "dull", "not", "never"):
        labels = [label for text, label in reviews if word in text.split()]
        assert 0.4 < labels.count("positive") / len(labels) < 0.6, word
    data = NegatedSentimentData(str(tokenizer_dir), root=str(tmp_path / "set"), train_size=40, val_size=10, test_size=10)
    data.setup()
    train = {line for line in (tmp_path / "set" / "train.csv").read_text().splitlines()[1:]}
    test = {line for line in (tmp_path / "set" / "test.csv").read_text().splitlines()[1:]}
    assert len(train) == 40 and not train & test and data.classes == ["negative", "positive"]


def _clause_label(words: list[str]) -> str:
    """The polarity of one clause read back from its words: the adjective's, flipped by a negation."""
    positive = any(word in generated_text.POSITIVE for word in words)
    negated = any(word in generated_text.NEGATIONS for word in words)
    return "positive" if positive != negated else "negative"


def test_two_clause_reviews_label_each_clause_and_no_token_decides(tmp_path, tokenizer_dir):
    """The harder set: four labels, each clause's polarity read back from the text; no word (an adjective, a
    negation, a conjunction) tells the label (each label 20-30% of the reviews holding it); the clause count is a
    short error otherwise."""
    import random

    rng = random.Random(1)
    reviews = [generated_text.two_clause_review(rng) for _ in range(4000)]
    splits = {"positive-positive", "positive-negative", "negative-positive", "negative-negative"}
    for text, label in reviews:
        words = text.split()
        cut = max(i for i, word in enumerate(words) if word in {"but", "and", "yet", "while", "whereas"})
        assert label == f"{_clause_label(words[:cut])}-{_clause_label(words[cut + 1:])}", text
    for word in ("good", "dull", "not", "never", "but", "whereas"):
        labels = [label for text, label in reviews if word in text.split()]
        assert all(0.2 < labels.count(label) / len(labels) < 0.3 for label in splits), word
    data = NegatedSentimentData(str(tokenizer_dir), root=str(tmp_path / "two"), train_size=80, val_size=10,
                                test_size=10, clauses=2, max_length=64)
    data.setup()
    assert data.classes == sorted(splits)
    with pytest.raises(ConfigError, match="data.clauses: expected 1 or 2 .* got 3"):
        NegatedSentimentData(str(tokenizer_dir), clauses=3)
