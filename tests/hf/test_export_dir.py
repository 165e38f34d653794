"""``export_dir`` never lands on what the user had: a folder holding files the run did not write, or another run's
export, stops ``fit`` before it trains, in one line (exit 2 from the command line, ``ConfigError`` from Python), with
the folder as it was; the run that wrote an export rewrites it when resumed in its own folder."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import CSVLogger
from training_helpers import error_lines, run_commands

from polyattn_lightning.data import GeneratedStoriesData
from polyattn_lightning.errors import ConfigError
from polyattn_lightning.tasks import HFCausalLM

ROOT = Path(__file__).resolve().parents[2]
TINY_LLAMA = ROOT / "configs" / "hf" / "tiny_llama_poly3.yaml"
SMALL = ["--trainer.accelerator", "cpu", "--trainer.limit_val_batches", "1", "--trainer.val_check_interval", "2",
         "--trainer.enable_progress_bar", "false", "--data.root", "stories", "--data.train_size", "200",
         "--data.val_size", "20", "--data.test_size", "20", "--data.batch_size", "8",
         "--model.init_args.test_after_fit", "false"]


def fit(*args: str) -> list[str]:
    return ["fit", "--config", str(TINY_LLAMA), *SMALL, *args]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


@pytest.mark.slow
def test_the_command_line_refuses_what_the_run_did_not_write_and_a_resumed_run_rewrites_its_own(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"model_type": "bert"}')
    (mine / "model.safetensors").write_bytes(b"the user's weights")
    users, exported = snapshot(mine), tmp_path / "exported"
    refused, first, second = run_commands(
        tmp_path,
        fit("--model.init_args.export_dir", "mine", "--trainer.max_steps", "2"),
        fit("--model.init_args.export_dir", "exported", "--trainer.max_steps", "2"),
        fit("--model.init_args.export_dir", "exported", "--trainer.max_steps", "2"),  # a new run, version_1
    )
    assert refused["rc"] == 2 and error_lines(refused["output"]) == [
        "error: model.init_args.export_dir mine already holds files this run did not write (config.json, "
        "model.safetensors); give a new or empty folder, or move them away (the export would overwrite them)"
    ], refused["output"]
    assert snapshot(mine) == users and "Traceback" not in refused["output"]
    assert first["rc"] == 0, first["output"][-3000:]
    run = (tmp_path / "runs" / "hf" / "tiny_llama_poly3" / "version_0").resolve()
    marker = json.loads((exported / "polyattn_export.json").read_text())
    assert marker == {"run_dir": str(run), "global_step": 2}
    written = snapshot(exported)
    assert second["rc"] == 2 and error_lines(second["output"]) == [
        f"error: model.init_args.export_dir exported holds the export of the run in {run}; give a new or empty "
        f"folder, or resume that run in its own folder (fit --ckpt_path {run / 'checkpoints' / 'last.ckpt'}), which "
        "rewrites its own export"
    ], second["output"]
    assert snapshot(exported) == written
    assert not (tmp_path / "runs" / "hf" / "tiny_llama_poly3" / "version_1").exists()  # removed: it never trained

    copy = tmp_path / "copy.ckpt"  # the run's checkpoint outside its folder: a run from it logs in a new folder
    copy.write_bytes((run / "checkpoints" / "last.ckpt").read_bytes())
    resumed, elsewhere, given = run_commands(
        tmp_path,
        fit("--trainer.max_steps", "3", "--ckpt_path", str(run / "checkpoints" / "last.ckpt")),
        fit("--trainer.max_steps", "3", "--ckpt_path", str(copy)),
        fit("--trainer.max_steps", "3", "--ckpt_path", str(copy), "--model.init_args.export_dir", "exported_again"),
    )
    assert resumed["rc"] == 0, resumed["output"][-3000:]  # export_dir came with the checkpoint's hyperparameters
    assert json.loads((exported / "polyattn_export.json").read_text()) == {"run_dir": str(run), "global_step": 3}
    rewritten = snapshot(exported)
    assert rewritten["model.safetensors"] != written["model.safetensors"]  # rewritten with step 3's weights
    assert elsewhere["rc"] == 2 and error_lines(elsewhere["output"]) == error_lines(second["output"])
    assert given["rc"] == 0, given["output"][-3000:]  # a given export_dir wins over the checkpoint's
    assert snapshot(exported) == rewritten and (tmp_path / "exported_again" / "model.safetensors").is_file()


@pytest.fixture(scope="module")
def stories(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("stories")
    GeneratedStoriesData(str(root), train_size=64, val_size=8, test_size=8).prepare_data()
    return root


def python_fit(export_dir: Path, stories: Path, logger) -> None:
    task = HFCausalLM(hf_config=dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4), export_dir=str(export_dir), test_after_fit=False)
    trainer = pl.Trainer(max_steps=1, logger=logger, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=export_dir.parent)
    trainer.fit(task, GeneratedStoriesData(str(stories), train_size=64, val_size=8, test_size=8, batch_size=8))


def test_python_gets_the_same_refusals_and_a_run_without_a_logger_exports_only_into_a_new_folder(tmp_path, stories):
    other = tmp_path / "other"
    other.mkdir()
    (other / "polyattn_export.json").write_text(json.dumps({"run_dir": "/runs/hf/x/version_3", "global_step": 9}))
    with pytest.raises(ConfigError) as refused:
        python_fit(other, stories, CSVLogger(tmp_path / "logs"))
    assert str(refused.value) == (
        f"model.init_args.export_dir {other} holds the export of the run in /runs/hf/x/version_3; give a new or empty "
        "folder, or resume that run in its own folder (fit --ckpt_path /runs/hf/x/version_3/checkpoints/last.ckpt), "
        "which rewrites its own export"
    )

    python_fit(tmp_path / "exported", stories, logger=False)  # a new folder: written, with a marker naming no run
    marker = json.loads((tmp_path / "exported" / "polyattn_export.json").read_text())
    assert marker == {"run_dir": None, "global_step": 1} and (tmp_path / "exported" / "model.safetensors").is_file()
    with pytest.raises(ConfigError) as again:  # another run without a logger: no run folder tells it is the same run
        python_fit(tmp_path / "exported", stories, logger=False)
    assert str(again.value) == (
        f"model.init_args.export_dir {tmp_path / 'exported'} holds an export written outside any run folder (polyattn "
        "consolidate, or a run without a logger); give a new or empty folder, or move it away"
    )
