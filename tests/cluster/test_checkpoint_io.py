"""Safe checkpoints: weights_only loading, a clear error for a bad file, and writes that cannot tear.

A checkpoint the configured trainer writes (callback, loader and RNG state
included) loads with ``weights_only=True`` and resumes through the CLI;
a file that would run code is refused without running it, as checkpoint and
as pretrained weights; every kind of damaged file raises an error naming it;
and a process killed in the middle of writing leaves the previous checkpoint intact.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from cluster_harness import digits, tiny_classifier
from training_helpers import cpu_trainer

from polyattn_lightning.callbacks import ExactResume, NonFiniteLossGuard
from polyattn_lightning.checkpoint import CheckpointLoadError, SafeCheckpointIO, load_checkpoint
from polyattn_lightning.cli import main, make_cli
from polyattn_lightning.tasks import ClassificationModule

ROOT = Path(__file__).parents[2]
QUICKSTART = ROOT / "configs" / "classification" / "quickstart.yaml"


@pytest.fixture(scope="module")
def cli_checkpoint(tmp_path_factory) -> Path:
    """``last.ckpt`` of one short quickstart epoch, written by the CLI-configured trainer."""
    run_dir = tmp_path_factory.mktemp("cli")
    fit_quickstart(run_dir, epochs=1)
    [last] = run_dir.rglob("last.ckpt")
    return last


def fit_quickstart(run_dir: Path, epochs: int, *args: str) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(run_dir)  # the config logs and checkpoints under ./runs
        main(["fit", "--config", str(QUICKSTART), "--trainer.max_epochs", str(epochs), "--trainer.limit_train_batches",
              "2", "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false", *args])


class RunsCode:
    """Unpickling this creates ``marker``: what a malicious checkpoint would do, harmlessly."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


@pytest.mark.parametrize("config", sorted(ROOT.glob("configs/**/trainer/*.yaml")), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_trainer_config_restates_a_standard_callback_or_the_checkpoint_io(config):
    """The CLI adds them to every run (SafeCheckpointIO as trainer.plugins' default): a trainer YAML keeps what differs."""
    trainer = yaml.safe_load(config.read_text())
    pieces = [yaml.safe_load((config.parent / piece).read_text()) for piece in trainer.get("callbacks", [])]
    assert "plugins" not in trainer and "logger" not in trainer
    opt_in = ("polyattn_lightning.callbacks.EMA", "polyattn_lightning.callbacks.AttentionMaps")
    assert all(piece["class_path"] in opt_in for piece in pieces)


def test_the_cli_builds_the_trainer_with_them():
    trainer = make_cli(["--config", str(QUICKSTART)], run=False).trainer
    assert isinstance(trainer.strategy.checkpoint_io, SafeCheckpointIO)
    kinds = [type(callback) for callback in trainer.callbacks]
    assert kinds.count(ExactResume) == 1 and kinds.count(NonFiniteLossGuard) == 1


def test_cli_checkpoint_loads_with_weights_only_and_resumes(cli_checkpoint, tmp_path):
    checkpoint = torch.load(cli_checkpoint, weights_only=True)
    assert checkpoint["global_step"] == 2
    assert len(checkpoint["rng_states"]) == 1
    assert load_checkpoint(cli_checkpoint)["state_dict"].keys() == checkpoint["state_dict"].keys()
    run_dir = shutil.copytree(cli_checkpoint.parents[1], tmp_path / "run")  # the resumed run goes on in its folder
    fit_quickstart(tmp_path, 2, "--ckpt_path", str(run_dir / "checkpoints" / "last.ckpt"))  # through SafeCheckpointIO
    [resumed] = tmp_path.rglob("last.ckpt")
    assert torch.load(resumed, weights_only=True)["global_step"] == 4


def test_python_api_checkpoint_loads_with_weights_only(tmp_path):
    """Hyperparameters given as the recipe dataclasses (optim, mixup; not YAML) must be weights_only-loadable too."""
    trainer = cpu_trainer(max_epochs=1, limit_train_batches=1, limit_val_batches=0, default_root_dir=tmp_path)
    trainer.fit(tiny_classifier(mixup=True), digits(batch_size=32))
    trainer.save_checkpoint(tmp_path / "api.ckpt")
    loaded = ClassificationModule.load_from_checkpoint(tmp_path / "api.ckpt", weights_only=True)
    assert loaded.mixup_recipe.mixup_alpha == 0.8 and loaded.hparams.optim.lr == 1e-3


def test_code_in_a_checkpoint_or_pretrained_file_is_refused_and_never_runs(tmp_path):
    marker, evil = tmp_path / "code-ran", tmp_path / "evil.pth"
    torch.save({"state_dict": {"w": torch.zeros(1)}, "payload": RunsCode(marker)}, evil)

    with pytest.raises(CheckpointLoadError, match=rf"{re.escape(str(evil))}.*weights_only"):
        SafeCheckpointIO().load_checkpoint(evil)
    with pytest.raises(Exception, match="weights_only|Unsupported global"):
        ClassificationModule("vit_tiny_patch16_224", num_classes=10, img_size=8, pretrained=str(evil),
                             model_kwargs={"patch_size": 2, "embed_dim": 32, "depth": 1, "num_heads": 2})
    assert not marker.exists()


def _damage(kind: str, data: bytes) -> bytes:
    if kind == "truncated":
        return data[: len(data) // 2]
    if kind == "cut_to_header":
        return data[:10]
    if kind == "empty":
        return b""
    if kind == "flipped_tensor_byte":  # the zip structure is fine; only a CRC notices
        middle = len(data) // 2
        return data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :]
    return os.urandom(len(data))


@pytest.mark.parametrize("kind", ["truncated", "cut_to_header", "empty", "flipped_tensor_byte", "random_bytes"])
def test_a_damaged_checkpoint_raises_an_error_naming_the_file(tmp_path, kind):
    good = tmp_path / "good.ckpt"
    torch.save({"state_dict": {"w": torch.randn(64, 64)}}, good)
    bad = tmp_path / f"{kind}.ckpt"
    bad.write_bytes(_damage(kind, good.read_bytes()))
    with pytest.raises(CheckpointLoadError, match=re.escape(str(bad))):
        SafeCheckpointIO().load_checkpoint(bad)


def test_resuming_from_a_damaged_checkpoint_fails_naming_it(cli_checkpoint, tmp_path):
    bad = tmp_path / "last.ckpt"
    bad.write_bytes(cli_checkpoint.read_bytes()[:-100])
    trainer = cpu_trainer(max_epochs=1)
    with pytest.raises(CheckpointLoadError, match=re.escape(f"{bad} is truncated or corrupt")):
        trainer.fit(tiny_classifier(), digits(batch_size=32), ckpt_path=bad)


@pytest.mark.parametrize("subcommand", ["fit", "validate"])
def test_cli_ckpt_path_to_a_damaged_checkpoint_names_it(cli_checkpoint, tmp_path, subcommand, capsys):
    """The CLI reads ``--ckpt_path``'s hyperparameters before the trainer loads it: that read must name the file too
    (as a user-input error: one ``error:`` line, exit status 2)."""
    bad = tmp_path / "last.ckpt"
    bad.write_bytes(cli_checkpoint.read_bytes()[: cli_checkpoint.stat().st_size // 2])
    with pytest.raises(SystemExit) as exit_info:
        main([subcommand, "--config", str(QUICKSTART), "--ckpt_path", str(bad)])  # fails before running
    assert exit_info.value.code == 2
    assert f"error: checkpoint {bad} is truncated or corrupt" in capsys.readouterr().err


def test_a_write_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    target = tmp_path / "last.ckpt"
    SafeCheckpointIO().save_checkpoint({"step": 1, "w": torch.ones(1000)}, target)
    crash = textwrap.dedent(f"""
        import os, torch
        from polyattn_lightning.checkpoint import SafeCheckpointIO

        def dies_halfway(obj, f):
            f.write(b"PK" + bytes(5000))
            f.flush()
            os._exit(9)  # killed: no exception handler, no cleanup runs

        torch.save = dies_halfway
        SafeCheckpointIO().save_checkpoint({{"step": 2, "w": torch.zeros(1000)}}, {str(target)!r})
    """)
    assert subprocess.run([sys.executable, "-c", crash]).returncode == 9
    assert load_checkpoint(target)["step"] == 1

    SafeCheckpointIO().save_checkpoint({"step": 3}, target)  # the next save replaces it as usual
    assert load_checkpoint(target) == {"step": 3}


def test_a_failed_write_leaves_the_previous_checkpoint_and_no_temporary_file(tmp_path, monkeypatch):
    target = tmp_path / "last.ckpt"
    SafeCheckpointIO().save_checkpoint({"step": 1}, target)

    def disk_full(obj, f):
        f.write(b"PK\x03\x04partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        SafeCheckpointIO().save_checkpoint({"step": 2}, target)
    assert load_checkpoint(target) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_remote_paths_go_through_lightnings_fsspec_io():
    io = SafeCheckpointIO()
    io.save_checkpoint({"step": 7, "w": torch.ones(3)}, "memory://bucket/last.ckpt")
    assert io.load_checkpoint("memory://bucket/last.ckpt")["step"] == 7
