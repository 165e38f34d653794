"""The HF configs through the CLI: every one builds; the two quickstarts, shortened, learn, and the trained LM decodes
the same with the cache."""
from __future__ import annotations

import json
import logging
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


@pytest.mark.slow  # the softmax baseline (35 s at load 6); the x^3 fine-tune below is the quickstart's claim
def test_minilm_quickstart_fine_tunes_above_the_majority_class(tmp_path, monkeypatch):
    """The softmax MiniLM fine-tune for 30 steps; the held-out set is balanced (majority 0.5)."""
    run = fit(tmp_path, monkeypatch, "minilm_softmax.yaml", "--trainer.max_epochs", "1",
              "--trainer.limit_train_batches", "30", "--data.train_size", "480", "--data.val_size", "100",
              "--data.test_size", "100")
    assert run.trainer.callback_metrics["test/top1"].item() > 0.6


def test_minilm_quickstart_converted_to_poly3_fine_tunes_above_the_majority_class(tmp_path, monkeypatch, caplog):
    """The x^3 fine-tune (attention transfer first, shortened to 20 steps) for 30 steps, as the softmax one above;
    the checkpoint holds the converted weights: rebuilt from it (no second conversion) it gives the same logits.
    transformers' LOAD REPORT (the new head's ``classifier.weight | MISSING``) comes without terminal escape codes,
    and one line says what the convert step changed."""
    monkeypatch.setattr("sys.stdout.isatty", lambda: True, raising=False)  # transformers colours for terminals
    transformers_logger = logging.getLogger("transformers")
    # transformers' logger propagates to the root only where the environment has CI=1/true (as CI runners set it):
    # its records would reach caplog's handler twice, directly and through the root; pinned off, once.
    monkeypatch.setattr(transformers_logger, "propagate", False)
    transformers_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level("INFO"):
            run = fit(tmp_path, monkeypatch, "minilm_poly3.yaml", "--trainer.max_epochs", "1",
                      "--trainer.limit_train_batches", "30", "--data.train_size", "480", "--data.val_size", "100",
                      "--data.test_size", "100", "--model.init_args.convert.steps", "20")
    finally:
        transformers_logger.removeHandler(caplog.handler)
    messages = [record.getMessage() for record in caplog.records]
    [report] = [message for message in messages if "LOAD REPORT" in message]
    assert "classifier.weight" in report and "MISSING" in report and "\x1b" not in report
    [line] = [message for message in messages if message.startswith("convert transfer to poly3:")]
    assert "6 layers, median layer error" in line and "folded" in line
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


#: layers a model from ``hf_config`` is built with here at most (its width stays the config's): the 1B example
#: builds 2 of its 22 layers (90M parameters, not 1B in the test process's memory).
TEST_LAYERS = 2


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
    init_args = yaml.safe_load(path.read_text())["model"]["init_args"]
    folder, hf_config = init_args.get("model"), init_args.get("hf_config")
    if folder is not None and not str(folder).startswith("package:"):  # a softmax teacher exported by another run
        export_teacher(tmp_path / folder, *data_args)
    shrink = []
    if hf_config and hf_config.get("num_hidden_layers", 0) > TEST_LAYERS:
        shrink = ["--model.init_args.hf_config", json.dumps({**hf_config, "num_hidden_layers": TEST_LAYERS})]
    run = built(path, *data_args, *shrink)
    model, data = run.model.model, run.datamodule
    assert model.get_input_embeddings().num_embeddings >= len(data.tokenizer)
    if data.num_classes is not None:  # sequence classification: a head of the data's classes
        assert model.config.num_labels == data.num_classes
    assert runs_activation(model, yaml.safe_load(path.read_text())["model"]["init_args"]["attention"])

