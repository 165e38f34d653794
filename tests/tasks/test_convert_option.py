"""The tasks' ``convert`` and ``lora`` options through the CLI, on each family that fine-tunes (timm classification,
HF sequence classification, HF causal LM): the convert step runs once, before the first step, is logged and saved
in the checkpoint, and a resumed run does not convert again; LoRA trains only the adapters (and a new head), resumes
exactly, and exports a merged model that loads without peft."""
from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from transformers import AutoModelForCausalLM
from training_helpers import QUICKSTART, Killed, KillAt, cpu_trainer, error_lines, fit, run_commands

from polyattn_lightning import cli
from polyattn_lightning.callbacks import ExactResume
from polyattn_lightning.conversion import ConvertRecipe
from polyattn_lightning.conversion.lora import LoraRecipe, is_lora
from polyattn_lightning.data import GeneratedStoriesData
from polyattn_lightning.tasks import HFCausalLM
from polyattn_lightning.attention import attention, attention_modules
from polyattn_lightning.attention.switch.hf import load_pretrained
from polyattn_lightning.checkpoint import load_checkpoint
from polyattn_lightning.errors import ConfigError
from polyattn_lightning.tasks.steps import convert as convert_step

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter is intended")

HF = Path(__file__).resolve().parents[2] / "configs" / "hf"
SHORT = ("--trainer.max_epochs", "1", "--trainer.limit_val_batches", "1")
LLAMA = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
FAST = dict(lr=3e-3, reference_batch=None, weight_decay=0.0, warmup_epochs=0.0, warmup_steps=2, warmup_lr=1e-5,
            min_lr=1e-4, schedule="cosine")
CONVERT = ("--model.init_args.convert.method", "transfer", "--model.init_args.convert.samples", "16",
           "--model.init_args.convert.steps", "4")


@pytest.fixture
def conversions(monkeypatch):
    """Every call of the convert step (the real one runs)."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[3])
        return real(*args, **kwargs)

    real = convert_step.convert
    monkeypatch.setattr(convert_step, "convert", counted)
    return calls


def trainable(task) -> list[str]:
    return [name for name, p in task.model.named_parameters() if p.requires_grad]


def test_classification_converts_once_trains_lora_and_resumes_without_converting(tmp_path, monkeypatch,
                                                                               conversions):
    monkeypatch.chdir(tmp_path)
    args = ("--config", str(QUICKSTART), *CONVERT, "--model.init_args.lora", "{r: 2, alpha: 4}",
            "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1")
    run = fit(*args, "--trainer.max_epochs", "1")
    assert conversions == ["transfer"]
    report = run.model.conversion
    assert report["method"] == "transfer" and report["transfer"]["steps"] <= 4
    assert len(report["error_after"]) == 4  # the quickstart ViT's 4 layers
    log_dir = tmp_path / "runs" / "classification" / "quickstart" / "version_0"
    assert (log_dir / "conversion.json").is_file() and (log_dir / "conversion.png").is_file()
    names = trainable(run.model)
    assert names and all("lora_" in n or n.startswith("head.") for n in names)
    ckpt = log_dir / "checkpoints" / "last.ckpt"
    saved = load_checkpoint(ckpt)
    assert saved[convert_step.CONVERSION_KEY] == report
    assert any("lora_A" in key for key in saved["state_dict"])
    resumed = fit(*args, "--trainer.max_epochs", "2", "--ckpt_path", str(ckpt))
    assert conversions == ["transfer"] and resumed.trainer.global_step == 4
    assert resumed.model.conversion == report  # carried on from the checkpoint
    assert convert_step.CONVERSION_KEY in load_checkpoint(ckpt)


def test_causal_lm_converts_trains_lora_and_exports_a_merged_model(tmp_path, monkeypatch, conversions):
    attention(*[torch.randn(1, 1, 4, 8)] * 3, "poly3")  # the C++ kernels load from their cache before it moves
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    run = fit("--config", str(HF / "tiny_llama_poly3.yaml"), "--data.train_size", "200", "--data.val_size", "40",
              "--data.test_size", "40", *CONVERT, "--model.init_args.lora", "{r: 4, alpha: 8}",
              "--model.init_args.export_dir", "exported", "--trainer.limit_val_batches", "1",
              "--trainer.max_steps", "3")
    assert run.trainer.global_step == 3 and conversions == ["transfer"]
    assert all("lora_" in n for n in trainable(run.model))
    exported = load_pretrained(tmp_path / "exported", AutoModelForCausalLM)
    assert not is_lora(exported) and [m.activation_spec for _, m in attention_modules(exported)] == ["poly3"] * 2
    ids = run.datamodule.val_set[0]["input_ids"][None]
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=ids).logits, run.model.model.eval()(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)


def train_lora(root, data, kill_at=None, ckpt_path=None):
    """6 LoRA steps of the tiny Llama after a transfer, a checkpoint every 2; killed before ``kill_at``."""
    pl.seed_everything(0)
    task = HFCausalLM(hf_config=LLAMA, attention="poly3", convert=ConvertRecipe(method="transfer", samples=8, steps=3),
                      lora=LoraRecipe(r=4, alpha=8), optim=FAST, test_after_fit=False)
    checkpoint = ModelCheckpoint(dirpath=root, save_last=True, every_n_train_steps=2)
    trainer = cpu_trainer(max_steps=6, enable_checkpointing=True, default_root_dir=root, limit_val_batches=0,
                          callbacks=[ExactResume(), KillAt(kill_at), checkpoint])
    trainer.ckpt_path = ckpt_path  # known before fit: the convert step is skipped, the checkpoint has its weights
    try:
        trainer.fit(task, datamodule=data)
    except Killed:
        return None
    return task, {"weights": task.state_dict(), "optimizer": trainer.optimizers[0].state_dict()["state"]}


def test_a_lora_run_killed_mid_way_resumes_exactly_without_converting_again(tmp_path, monkeypatch, conversions):
    attention(*[torch.randn(1, 1, 4, 8)] * 3, "poly3")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    data = GeneratedStoriesData(train_size=120, val_size=16, test_size=16, batch_size=8)
    task, reference = train_lora(tmp_path / "reference", data)
    assert conversions == ["transfer"]
    assert train_lora(tmp_path / "killed", data, kill_at=3) is None  # the last checkpoint: step 2
    resumed_task, resumed = train_lora(tmp_path / "killed", data, ckpt_path=tmp_path / "killed" / "last.ckpt")
    assert conversions == ["transfer", "transfer"]  # the reference and the killed run; not the resumed one
    assert resumed_task.conversion == load_checkpoint(tmp_path / "killed" / "last.ckpt")[convert_step.CONVERSION_KEY]
    assert resumed_task.conversion["error_after"] == task.conversion["error_after"]  # the same, deterministic
    assert any("lora_B" in name for name in reference["weights"])
    for name, weight in reference["weights"].items():
        assert torch.equal(resumed["weights"][name], weight), name
    for index, state in reference["optimizer"].items():
        assert torch.equal(resumed["optimizer"][index]["exp_avg"], state["exp_avg"])


def test_hf_classification_takes_convert_and_lora_and_maps_the_deprecated_calibrate_key(tmp_path, monkeypatch,
                                                                                     conversions):
    attention(*[torch.randn(1, 1, 4, 8)] * 3, "poly3")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    args = ("--config", str(HF / "minilm_poly3.yaml"), "--data.train_size", "64", "--data.val_size", "16",
            "--data.test_size", "16", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1",
            "--trainer.max_epochs", "1", "--model.init_args.test_after_fit", "false")
    run = fit(*args, *CONVERT, "--model.init_args.lora", "{r: 2, target: [q, v]}")
    assert conversions == ["transfer"]
    names = trainable(run.model)
    assert any("lora_" in n for n in names) and all("lora_" in n or n.startswith("classifier.") for n in names)
    with pytest.warns(FutureWarning, match="calibrate_attention is deprecated: it is model.init_args.convert.method"):
        old = fit(*args, "--model.init_args.convert.method", "none", "--model.init_args.calibrate_attention", "true")
    assert conversions == ["transfer", "calibrate"] and old.model.hparams.convert["method"] == "calibrate"
    assert "calibrate_attention" not in old.model.hparams
    with pytest.raises(ConfigError, match="the conversion is given twice, as model.init_args.convert.method "
                                          "transfer and as calibrate_attention: true"):
        fit(*args, *CONVERT, "--model.init_args.calibrate_attention", "true")


def test_bad_convert_and_lora_options_stop_before_any_model_is_built(capsys):
    for option, message in ((("--model.init_args.convert.method", "distill"),
                             "model.init_args.convert.method: 'distill' is not one of none, calibrate, transfer"),
                            (("--model.init_args.lora", "{r: 0}"), "model.init_args.lora.r must be at least 1")):
        with pytest.raises((SystemExit, ConfigError)) as error:
            cli.main(["fit", "--config", str(QUICKSTART), *option])
        assert message in str(error.value) + capsys.readouterr().err


def test_convert_on_the_command_line_refuses_an_unknown_option_in_one_line_and_warns_on_too_few_samples(tmp_path):
    """As a user runs them, each its own process: a misspelt key of the convert mapping (given whole on the
    command line to a timm task, in a config file to an HF one) is one line naming the closest, exit 2, nothing
    written; too few samples to judge the transfer by is one warning line in a run that goes on."""
    (tmp_path / "convert.yaml").write_text("model: {init_args: {convert: {method: transfer, hold_out: 0.2}}}\n")
    cases = [
        (["fit", "--config", str(QUICKSTART), "--model.init_args.convert", "{method: transfer, hold_out: 0.2}"],
         "ClassificationModule"),
        (["fit", "--config", str(HF / "minilm_poly3.yaml"), "--config", "convert.yaml"], "HFSequenceClassification"),
    ]  # fmt: skip
    few = ["fit", "--config", str(QUICKSTART), "--model.init_args.convert", "{method: transfer, samples: 8, steps: 4}"]
    few += "--trainer.max_steps 1 --trainer.limit_val_batches 1 --trainer.limit_test_batches 1".split()
    *refused, ran = run_commands(tmp_path, *(argv for argv, _ in cases), few)
    for (argv, task), result in zip(cases, refused):
        assert result["rc"] == 2 and error_lines(result["output"]) == [
            f"error: model.init_args.convert.hold_out is not an option of {task} "
            "(did you mean model.init_args.convert.holdout?)"
        ], (argv, result["output"])
        assert "Traceback" not in result["output"]
    assert ran["rc"] == 0, ran["output"][-3000:]
    said = [line.split(": ", 1)[1] for line in ran["output"].splitlines() if ": convert: " in line]
    assert said[0] == (
        "convert: only 2 of 8 samples held out (holdout 0.25), fewer than 8: too few to judge the transfer on samples "
        "it has not seen (its stop and its held-out error are noise); give at least 32 samples"
    )
    assert [path.relative_to(tmp_path) for path in tmp_path.rglob("conversion.json")] == [
        Path("runs/classification/quickstart/version_0/conversion.json")
    ]  # the refused commands wrote no run of their own
