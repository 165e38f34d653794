"""What a new user meets: short errors for bad input, a loading report, outputs where documented, check-data.

Every case runs ``polyattn ...`` as its own process (``cli_driver.py`` forks them from one process that
imported the CLI once, to keep the test time small) on a tiny ViT and a 3-class JPEG image folder.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
import yaml
from PIL import Image
from safetensors.torch import save_file

from polyattn_lightning import cli
from polyattn_lightning.errors import UserInputError, reported

DRIVER = Path(__file__).with_name("cli_driver.py")
CLASSES = ("cat", "dog", "fox")
MODEL_KWARGS = {"patch_size": 4, "embed_dim": 32, "depth": 1, "num_heads": 2}
TRAINER = Path(__file__).resolve().parents[2] / "configs" / "classification" / "trainer" / "quickstart.yaml"


def write_folder(root: Path, classes=CLASSES, train: int = 4, val: int = 2) -> Path:
    """ImageNet-style ``train/<class>/*.JPEG`` and ``val/<class>/*.JPEG``, 16 px noise images."""
    for label, name in enumerate(classes):
        for split, count in (("train", train), ("val", val)):
            for i in range(count):
                path = root / split / name / f"{name}{i}.JPEG"
                path.parent.mkdir(parents=True, exist_ok=True)
                pixels = np.random.default_rng(100 * label + i).integers(0, 256, (16, 16, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(path, format="JPEG")
    return root


def write_config(path: Path, root: Path) -> Path:
    config = {
        "seed_everything": 0,
        "trainer": str(TRAINER),
        "model": {"class_path": "ClassificationModule", "init_args": {
            "model_name": "vit_tiny_patch16_224", "num_classes": 3, "img_size": 16,
            "model_kwargs": MODEL_KWARGS, "attention": "poly3"}},
        "data": {"class_path": "ImageFolderDataModule", "init_args": {
            "root": str(root), "img_size": 16, "batch_size": 4, "num_workers": 0}},  # pin_memory: its default
    }
    path.write_text(yaml.safe_dump(config))
    return path


def run(cwd: Path, *cases: list[str] | tuple[list[str], dict]) -> list[dict]:
    """Run each case (argv, or (argv, extra environment)) as ``polyattn ARGV`` in ``cwd``; their rc and output. The
    test helpers and the cluster tests' callbacks (``tests``, ``tests/cluster``) can be named in ``class_path``."""
    specs = [{"argv": case[0], "env": case[1]} if isinstance(case, tuple) else {"argv": case} for case in cases]
    cases_file = cwd / "cases.json"
    cases_file.write_text(json.dumps(specs))
    tests = Path(__file__).resolve().parents[1]
    pythonpath = os.pathsep.join(filter(None, [str(tests), str(tests / "cluster"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "POLYATTN_DEBUG": "0", "PYTHONPATH": pythonpath}
    subprocess.run([sys.executable, str(DRIVER), str(cases_file)], cwd=cwd, env=env, check=True, timeout=900)
    return json.loads(Path(f"{cases_file}.out").read_text())


def assert_short_error(result: dict, *expected: str, max_lines: int = 6) -> str:
    """Exit status 2, one ``error:`` line naming the problem, no traceback, a few lines in all."""
    output = result["output"]
    assert result["rc"] == 2, output
    assert "Traceback" not in output, output
    error = output[output.index("error: "):]
    for text in expected:
        assert text in error, output
    assert len(error.splitlines()) <= max_lines, output
    return error


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A working directory with ``imgs/`` (3 classes) and ``folder.yaml`` training a 1-layer ViT on it."""
    write_config(tmp_path / "folder.yaml", write_folder(tmp_path / "imgs"))
    return tmp_path


def test_bad_input_gives_one_short_error_without_traceback(project: Path):
    weights = project / "corrupt.safetensors"
    save_file({"w": torch.zeros(1000)}, weights)
    weights.write_bytes(weights.read_bytes()[:100])
    (project / "truncated.ckpt").write_bytes(b"PK\x03\x04" + b"\0" * 50)
    torch.save({"w": torch.zeros(3)}, project / "weights.pth")
    (project / "broken.yaml").write_text("trainer: {max_epochs: 1\nmodel:\n  init_args: {}\n")
    fit = ["fit", "--config", "folder.yaml", "--trainer.max_epochs", "1"]
    results = run(
        project,
        [*fit, "--model.attention", "poly3x"],
        [*fit, "--model.attention", "{name: poly3, scale: -1}"],
        [*fit, "--model.model_name", "vit_tinny_patch16_224"],
        [*fit, "--model.pretrained", "missing.safetensors"],
        [*fit, "--model.pretrained", "corrupt.safetensors"],
        [*fit, "--data.root", "nowhere"],
        ["validate", "--config", "folder.yaml", "--ckpt_path", "missing.ckpt"],
        ["validate", "--config", "folder.yaml", "--ckpt_path", "truncated.ckpt"],
        [*fit, "--trainer.max_epoch", "1"],
        [*fit, "--model.num_classes", "abc"],
        [*fit, "--model.num_classes", "5", "--model.attention", "poly3"],  # the config's activation: no suffix
        [*fit, "--model.img_size", "32"],
        ([*fit, "--model.attention", "poly3x"], {"POLYATTN_DEBUG": "1"}),
        [*fit, "--config", "broken.yaml"],
        ["validate", "--config", "folder.yaml", "--ckpt_path", "weights.pth"],
        [*fit, "--data.batch_size", "32"],  # 12 training images: no full batch
    )
    assert_short_error(results[0], "model.init_args.attention", "unknown attention activation 'poly3x'", "registered:")
    assert_short_error(results[1], "scale must be positive, got -1")
    assert_short_error(results[2], "unknown timm model 'vit_tinny_patch16_224'", "vit_tiny_patch16_224")
    assert_short_error(results[3], "model.init_args.pretrained", "missing.safetensors not found", "expected")
    assert_short_error(results[4], "corrupt.safetensors are truncated or corrupt")
    assert_short_error(results[5], "data directory nowhere does not exist", "expected layout")
    assert_short_error(results[6], "--ckpt_path missing.ckpt: no such checkpoint file")
    assert_short_error(results[7], "checkpoint truncated.ckpt is truncated or corrupt")
    assert_short_error(results[8], "unknown option --trainer.max_epoch (did you mean --trainer.max_epochs?)")
    assert_short_error(results[9], 'Parser key "num_classes"', "Expected a <class 'int'>. Got value: abc")
    assert "Does not validate against any of the Union subtypes" not in results[9]["output"]
    # errors found after the run started: still short, and no empty version folder left behind
    assert_short_error(results[10], "model.init_args.num_classes is 5 but ImageFolderDataModule has num_classes=3")
    assert f"to {Path('runs/classification/folder/version_0')}\n" in results[10]["output"]
    assert_short_error(results[11], "model.init_args.img_size is 32 but ImageFolderDataModule has img_size=16")
    assert results[12]["rc"] != 0 and "Traceback" in results[12]["output"]  # POLYATTN_DEBUG=1
    assert_short_error(results[13], "broken.yaml is not valid YAML", 'in "broken.yaml", line 1', max_lines=8)
    assert_short_error(results[14], "--ckpt_path weights.pth is not a Lightning checkpoint", "--model.pretrained")
    assert_short_error(results[15], "ImageFolderDataModule: the training split has 12 samples, fewer than "
                       "data.batch_size 32", "no training batch; give --data.batch_size 12 or less")
    assert "No training batches" not in results[15]["output"]
    assert not (project / "runs").exists()  # no empty run folder left behind by any of them


def test_a_missing_checkpoint_lists_those_near_it_and_a_misspelled_key_names_its_class_help(project: Path):
    run_dir = project / "runs" / "classification" / "folder" / "version_0"
    (run_dir / "checkpoints").mkdir(parents=True)
    for name in ("best-epoch001.ckpt", "last.ckpt"):
        (run_dir / "checkpoints" / name).write_bytes(b"not read: only listed")
    (run_dir / "config.yaml").write_text((project / "folder.yaml").read_text())
    (project / "elsewhere").mkdir()
    fit = ["fit", "--config", "folder.yaml"]
    results = run(
        project,
        ["validate", "--config", "folder.yaml", "--ckpt_path", str(run_dir / "checkpoints" / "bset.ckpt")],
        ["test", "--ckpt_path", "runs/classification/folder/version_1/checkpoints/last.ckpt"],  # no --config
        ["validate", "--config", "folder.yaml", "--ckpt_path", "runz/last.ckpt"],  # the working directory's runs/
        ["validate", "--config", "folder.yaml", "--ckpt_path", "elsewhere/last.ckpt"],
        [*fit, "--data.rooot", "imgs"],
        [*fit, "--model.model_nam", "vit_tiny_patch16_224"],
        [*fit, "--trainer.max_epoch", "1"],
    )
    listed = [f"  {Path('runs/classification/folder/version_0/checkpoints', name)}"
              for name in ("best-epoch001.ckpt", "last.ckpt")]
    for result, given, under in (
        (results[0], run_dir / "checkpoints" / "bset.ckpt", "runs/classification/folder/version_0/checkpoints"),
        (results[1], "runs/classification/folder/version_1/checkpoints/last.ckpt", "runs/classification/folder"),
        (results[2], "runz/last.ckpt", "runs"),
    ):
        assert_short_error(result, f"--ckpt_path {given}: no such checkpoint file or sharded folder; the checkpoints "
                           f"under {Path(under)}:\n" + "\n".join(listed) + "\n", max_lines=4)
    assert_short_error(results[3], "--ckpt_path elsewhere/last.ckpt: no such checkpoint file or sharded folder; "
                       "there is no checkpoint (*.ckpt) under elsewhere\n")
    prog = "polyattn fit"
    data_error = assert_short_error(results[4], "data.init_args.rooot is not an option of ImageFolderDataModule "
                                    "(did you mean data.init_args.root?)")
    assert data_error.splitlines()[1].startswith(f"(`{prog} --data.help ImageFolderDataModule` lists the options of "
                                                 "ImageFolderDataModule"), data_error
    model_error = assert_short_error(results[5], "model.init_args.model_nam is not an option of ClassificationModule "
                                     "(did you mean model.init_args.model_name?)")
    assert f"`{prog} --model.help ClassificationModule` lists the options of ClassificationModule" in model_error
    trainer_error = assert_short_error(results[6], "did you mean --trainer.max_epochs?")
    assert f"(`{prog} --help` lists every option;" in trainer_error and "ClassificationModule`" not in trainer_error


def test_internal_errors_keep_their_traceback():
    @reported
    def broken():
        raise RuntimeError("a bug")

    @reported
    def wrapped():
        try:
            raise UserInputError("bad value")
        except UserInputError as err:
            raise ValueError("Does not validate against any of the Union subtypes") from err

    with pytest.raises(RuntimeError, match="a bug"):
        broken()
    with pytest.raises(SystemExit) as exit_info:
        wrapped()
    assert exit_info.value.code == 2


def test_runs_report_loading_and_write_where_documented(project: Path):
    """Fine-tuning logs what was loaded; validate/predict of a checkpoint write beside its run, not as versions."""
    source = timm.create_model("vit_tiny_patch16_224", num_classes=1000, img_size=32, **MODEL_KWARGS)
    save_file(source.state_dict(), project / "in1k.safetensors")
    write_folder(project / "imgs5", classes=("a", "b", "c", "d", "e"), train=1, val=1)
    short = ["--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1", "--trainer.max_epochs", "1",
             "--trainer.enable_progress_bar", "false"]
    ckpt = "runs/classification/folder/version_0/checkpoints/last.ckpt"
    (project / "weights").mkdir()
    torch.save({"state_dict": {}}, project / "weights" / "last.ckpt")
    results = run(
        project,
        ["fit", "--config", "folder.yaml", *short, "--model.pretrained", "in1k.safetensors"],
        ["validate", "--config", "folder.yaml", "--ckpt_path", ckpt, "--trainer.enable_progress_bar", "false"],
        ["predict", "--config", "folder.yaml", "--ckpt_path", ckpt, "--trainer.enable_progress_bar", "false"],
        ["validate", "--config", "folder.yaml", "--ckpt_path", ckpt, "--data.root", "imgs5"],
        ["fit", "--config", "folder.yaml", *short, "--model.attention", "relu"],
        # the checkpoint alone: its run's saved config.yaml; each call its own folder, none overwritten
        ["validate", "--ckpt_path", ckpt, "--trainer.enable_progress_bar", "false"],
        ["test", "--ckpt_path", ckpt, "--trainer.enable_progress_bar", "false"],
        ["predict", "--ckpt_path", ckpt, "--trainer.enable_progress_bar", "false"],
        ["validate", "--ckpt_path", "weights/last.ckpt"],  # a checkpoint outside a run folder
    )
    fit_output = results[0]["output"]
    assert results[0]["rc"] == 0, fit_output
    assert "pretrained weights in1k.safetensors:" in fit_output
    assert "re-initialised: head.weight, head.bias (the file has 1000 classes, the model 3)" in fit_output
    assert "resampled: pos_embed [1, 65, 32] -> [1, 17, 32]" in fit_output
    run_dir = project / "runs" / "classification" / "folder" / "version_0"
    assert f"writing logs, config and checkpoints/ to {Path('runs/classification/folder/version_0')}" in fit_output
    assert "wrote runs/classification/folder/version_0/: " in fit_output and "checkpoints/last.ckpt" in fit_output
    for noise in ("No CUDA runtime is found", "litlogger", "LeafSpec", "pin_memory"):  # every CPU run printed them
        assert noise not in fit_output

    assert results[1]["rc"] == 0, results[1]["output"]
    assert "checkpoint runs/classification/folder/version_0/checkpoints/last.ckpt:" in results[1]["output"]  # the --ckpt_path report
    assert (run_dir / "validate_last" / "config.yaml").is_file()
    assert "dirpath has changed" not in results[1]["output"]
    assert results[2]["rc"] == 0, results[2]["output"]
    saved = torch.load(run_dir / "predict_last" / "predictions" / "rank0.pt", weights_only=True)
    assert saved["classes"] == list(CLASSES)
    assert [Path(p).relative_to(project / "imgs" / "val").parent.name for p in saved["paths"]] == [
        name for name in CLASSES for _ in range(2)]
    assert saved["predictions"].shape == (6, 3)
    assert sorted(path.name for path in (project / "runs" / "classification" / "folder").iterdir()) == ["version_0"]

    error = assert_short_error(results[3], f"checkpoint {ckpt} has num_classes=3", "saved hyperparameters",
                               "ImageFolderDataModule has num_classes=5")
    assert "set model.init_args.num_classes" not in error
    assert results[4]["rc"] == 0, results[4]["output"]
    assert (project / "runs" / "classification" / "folder_relu" / "version_0" / "checkpoints" / "last.ckpt").is_file()

    for result, verb, folder in zip(results[5:8], ("validate", "test", "predict"),
                                    ("validate_last_2", "test_last", "predict_last_2")):
        output = result["output"]
        assert result["rc"] == 0, output
        assert f"{verb}: no --config given: using {run_dir.relative_to(project)}/config.yaml" in output
        assert "LightningCLI's args parameter" not in output  # the command line, with the config added: no warning
        assert f"to {Path('runs/classification/folder/version_0') / folder}\n" in output
    assert "test/top1" in results[6]["output"]
    again = torch.load(run_dir / "predict_last_2" / "predictions" / "rank0.pt", weights_only=True)
    torch.testing.assert_close(again["predictions"], saved["predictions"])  # the same data, from the saved config
    first = torch.load(run_dir / "predict_last" / "predictions" / "rank0.pt", weights_only=True)
    assert first["paths"] == saved["paths"]  # the first call's file is still there, as written
    assert sorted(path.name for path in run_dir.iterdir() if path.is_dir()) == [
        "checkpoints", "predict_last", "predict_last_2", "test_last", "validate_last", "validate_last_2"]
    assert_short_error(results[8], "--ckpt_path weights/last.ckpt: no --config given and no config.yaml beside it")


def test_check_data_names_every_unreadable_image(project: Path):
    bad = [project / "imgs" / "train" / "cat" / "cat0.JPEG", project / "imgs" / "val" / "dog" / "dog1.JPEG",
           project / "imgs" / "train" / "fox" / "fox3.JPEG"]
    bad[0].write_bytes(b"not an image")
    bad[1].write_bytes(bad[1].read_bytes()[:200])  # truncated
    bad[2].write_bytes(b"")
    results = run(
        project,
        ["check-data", "--config", "folder.yaml", "--workers", "2"],
        ["fit", "--config", "folder.yaml", "--data.check_images", "true"],
        ["fit", "--config", "folder.yaml", "--trainer.max_epochs", "1"],  # without the check: the first bad file
        ["fit", "--config", "folder.yaml", "--trainer.max_epochs", "1", "--data.num_workers", "1"],  # in a worker
    )
    assert_short_error(results[0], "3 of 18 images of ImageFolderDataModule cannot be read")
    listing = results[0]["output"].split("error: ")[0]  # one line per bad file, then the error
    for path in bad:
        assert f"{path.relative_to(project)}: " in listing
    error = assert_short_error(results[1], "3 of 18 images cannot be read", max_lines=8)
    assert all(str(path.relative_to(project)) in error for path in bad)
    assert not (project / "runs").exists()
    assert_short_error(results[2], f"cannot read image {project / 'imgs'}", max_lines=6)
    error = assert_short_error(results[3], f"cannot read image {project / 'imgs'}", max_lines=6)
    assert "DataLoader worker" not in error


def test_data_help_spells_out_the_layout(capsys, monkeypatch):
    """``--data.root``'s help is read on the command line, where ``layout`` (a class attribute) is not visible."""
    monkeypatch.setattr(sys, "argv", ["polyattn"])  # the arguments are given below, not pytest's
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", "--data.help", "ImageFolderDataModule"])
    assert exit_info.value.code in (0, None)
    root_help = capsys.readouterr().out.split("--data.root ROOT", 2)[2].split("--data.img_size")[0]
    assert "<root>/train/<class>/<image>" in root_help and "layout" not in root_help
