"""The HF configs through the CLI: every one builds; the two quickstarts, shortened, learn, and the trained LM decodes
the same with the cache."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from training_helpers import built, experiment_configs, runs_activation

from polyattn_lightning import cli
from polyattn_lightning.attention import attention
from polyattn_lightning.tasks import HFSequenceClassification

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter is intended")

HF = Path(__file__).resolve().parents[2] / "configs" / "hf"


def fit(tmp_path, monkeypatch, config: str, *args: str):
    attention(*[torch.randn(1, 1, 4, 8)] * 3, "poly3")  # the C++ kernels load from their cache before it moves
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    return cli.make_cli(["fit", "--config", str(HF / config), "--trainer.enable_progress_bar", "false", *args])


def test_tiny_llama_quickstart_learns_and_decodes_the_same_with_the_kv_cache(tmp_path, monkeypatch):
    run = fit(tmp_path, monkeypatch, "tiny_llama_poly3.yaml", "--trainer.max_epochs", "1",
              "--trainer.limit_train_batches", "60", "--data.val_size", "100", "--data.test_size", "100")
    assert run.trainer.global_step == 60
    vocab = run.datamodule.vocab_size
    assert run.trainer.callback_metrics["test/perplexity"].item() < vocab / 8  # untrained: about the vocabulary size
    model = run.model.model.eval()
    prompt = run.datamodule.tokenizer("alice has 3 apples and bob has", return_tensors="pt")["input_ids"]
    tokens = [model.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=cache,
                             pad_token_id=run.datamodule.tokenizer.pad_token_id) for cache in (True, False)]
    assert torch.equal(tokens[0], tokens[1])


def test_minilm_quickstart_fine_tunes_above_the_majority_class(tmp_path, monkeypatch):
    """The softmax MiniLM fine-tune for 30 steps; the held-out set is balanced (majority 0.5)."""
    run = fit(tmp_path, monkeypatch, "minilm_softmax.yaml", "--trainer.max_epochs", "1",
              "--trainer.limit_train_batches", "30", "--data.train_size", "480", "--data.val_size", "100",
              "--data.test_size", "100")
    assert run.trainer.callback_metrics["test/top1"].item() > 0.6


def test_minilm_quickstart_converted_to_poly3_fine_tunes_above_the_majority_class(tmp_path, monkeypatch):
    """The x^3 fine-tune (attention transfer first, shortened to 20 steps) for 30 steps, as the softmax one above;
    the checkpoint holds the converted weights: rebuilt from it (no second conversion) it gives the same logits."""
    run = fit(tmp_path, monkeypatch, "minilm_poly3.yaml", "--trainer.max_epochs", "1",
              "--trainer.limit_train_batches", "30", "--data.train_size", "480", "--data.val_size", "100",
              "--data.test_size", "100", "--model.init_args.convert.steps", "20")
    assert run.trainer.callback_metrics["test/top1"].item() > 0.6
    [best] = (tmp_path / "runs" / "hf" / "minilm_poly3" / "version_0" / "checkpoints").glob("best-*.ckpt")
    saved = torch.load(best, weights_only=True)
    hyperparameters = saved["hyper_parameters"]
    assert hyperparameters["attention"] == "poly3" and hyperparameters["convert"]["method"] == "transfer"
    report = saved["polyattn_conversion"]
    assert max(report["error_after"]) < min(report["error_before"])  # every layer nearer its softmax output
    assert hyperparameters["built_config"]["model_type"] == "bert"
    restored = HFSequenceClassification.load_from_checkpoint(best, weights_only=True).eval()
    batch = run.datamodule.collate_fn([run.datamodule.val_set[i] for i in range(8)])
    with torch.no_grad():  # one epoch: the best checkpoint is the last weights
        torch.testing.assert_close(restored(batch), run.model.eval()(batch), atol=1e-5, rtol=1e-5)


def export_teacher(folder: Path, *data_args: str) -> None:
    """What ``configs/hf/convert/`` starts from, tiny: the softmax Llama quickstart's model (untrained) and tokenizer,
    saved as its ``export_dir`` would."""
    run = built(HF / "tiny_llama_softmax.yaml", *data_args)
    run.model.model.save_pretrained(folder)
    run.datamodule.tokenizer.save_pretrained(folder)


@pytest.mark.parametrize("path", experiment_configs(HF), ids=lambda p: p.stem)
def test_experiment_config_builds(tmp_path, monkeypatch, path: Path):
    """Model and data built through the CLI as ``fit`` would, on small generated sets written under ``tmp_path``."""
    monkeypatch.chdir(tmp_path)
    data_args = ("--data.root", str(tmp_path / "data"), "--data.train_size", "64", "--data.val_size", "16",
                 "--data.test_size", "16")
    folder = yaml.safe_load(path.read_text())["model"]["init_args"].get("model")
    if folder is not None and not str(folder).startswith("package:"):  # a softmax teacher exported by another run
        export_teacher(tmp_path / folder, *data_args)
    run = built(path, *data_args)
    model, data = run.model.model, run.datamodule
    assert model.get_input_embeddings().num_embeddings >= len(data.tokenizer)
    if data.num_classes is not None:  # sequence classification: a head of the data's classes
        assert model.config.num_labels == data.num_classes
    assert runs_activation(model, yaml.safe_load(path.read_text())["model"]["init_args"]["attention"])
