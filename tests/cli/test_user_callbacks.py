"""A user's own ``trainer.callbacks``, as Lightning's docs write them, run as written and resume: an entry with a
standard callback's identity (``state_key``) replaces it, a short key given explicitly beats such an entry, a
user ModelCheckpoint writing last.ckpt turns the standard last checkpoint off, and an old saved config.yaml
(listing every standard callback) runs with its own settings."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

from polyattn_lightning import cli
from polyattn_lightning.callbacks import (
    AttentionNorms,
    ExactResume,
    LastCheckpoint,
    NonFiniteLossError,
    NonFiniteLossGuard,
    StopOnSignal,
)
from polyattn_lightning.callbacks.standard import STANDARD_KEYS
from polyattn_lightning.errors import ConfigError

from test_standard_callbacks import OLD_RUN, QUICKSTART, fit

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter is intended")

#: the three callbacks Lightning users list most, with settings of their own
USER_CALLBACKS = {"trainer": {"callbacks": [
    {"class_path": "ModelCheckpoint", "init_args": {"monitor": "val/top1", "mode": "max", "save_last": True}},
    {"class_path": "NonFiniteLossGuard", "init_args": {"on_nonfinite": "skip"}},
    {"class_path": "EarlyStopping", "init_args": {"monitor": "val/top1", "mode": "max", "patience": 7}},
]}}
#: the same three on the command line, with jsonargparse's append syntax
APPENDED = ["--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.monitor=val/top1",
            "--trainer.callbacks.mode=max", "--trainer.callbacks.save_last=true",
            "--trainer.callbacks+=NonFiniteLossGuard", "--trainer.callbacks.on_nonfinite=skip",
            "--trainer.callbacks+=EarlyStopping", "--trainer.callbacks.monitor=val/top1",
            "--trainer.callbacks.mode=max", "--trainer.callbacks.patience=7"]


def of_type(callbacks, cls) -> list:
    return [callback for callback in callbacks if type(callback) is cls]


def info_lines(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.getMessage().startswith("trainer.callbacks:")]


def assert_users_callbacks_run(callbacks) -> None:
    """The user's ModelCheckpoint, skip guard and EarlyStopping, each once; the standard ones they replace absent."""
    [checkpoint] = of_type(callbacks, ModelCheckpoint)
    assert (checkpoint.monitor, checkpoint.mode, checkpoint.save_last) == ("val/top1", "max", True)
    assert [guard.on_nonfinite for guard in of_type(callbacks, NonFiniteLossGuard)] == ["skip"]
    [stopping] = of_type(callbacks, EarlyStopping)
    assert (stopping.monitor, stopping.patience) == ("val/top1", 7)
    assert not of_type(callbacks, LastCheckpoint)  # the user's save_last writes last.ckpt
    assert len(of_type(callbacks, ExactResume)) == len(of_type(callbacks, StopOnSignal)) == 1  # the others stay


@pytest.mark.parametrize("form", ["yaml", "append"])
def test_a_users_callbacks_are_honoured_and_resume(tmp_path, caplog, form):
    if form == "yaml":
        (tmp_path / "callbacks.yaml").write_text(yaml.safe_dump(USER_CALLBACKS))
        given = ["--config", str(tmp_path / "callbacks.yaml")]
    else:
        given = APPENDED
    with caplog.at_level("INFO"):
        run = fit(tmp_path, *given, "--callbacks_off", "[norms]", "--trainer.val_check_interval", "4")
    assert run.trainer.global_step == 4  # the NaN step at 1 was skipped, as the listed guard says
    assert all(torch.isfinite(p).all() for p in run.model.parameters())
    assert_users_callbacks_run(run.trainer.callbacks)
    lines = info_lines(caplog)
    assert len(lines) == 3, lines  # one line per decision, naming the short key
    for key in ("--checkpoint:", "--nan_guard:", "--last_checkpoint"):
        assert sum(key in line for line in lines) == 1, lines
    assert any("on_nonfinite='skip'" in line for line in lines)
    log_dir = Path(run.trainer.log_dir)
    names = sorted(path.name for path in (log_dir / "checkpoints").glob("*.ckpt"))
    assert names == ["epoch=0-step=4.ckpt", "last.ckpt"]  # the user's file names: Lightning's defaults

    # resume from the run's own saved config: the same callbacks, the checkpoint's callback states restored
    saved = log_dir / "config.yaml"
    resumed = cli.make_cli(["fit", "--config", str(saved), "--ckpt_path", str(log_dir / "checkpoints" / "last.ckpt"),
                            "--trainer.max_steps", "8"])
    assert resumed.trainer.global_step == 8
    assert_users_callbacks_run(resumed.trainer.callbacks)
    [stopping] = of_type(resumed.trainer.callbacks, EarlyStopping)
    first = torch.load(log_dir / "checkpoints" / "last.ckpt", weights_only=True)["callbacks"]
    assert first[stopping.state_key]["patience"] == 7
    states = torch.load(Path(resumed.trainer.log_dir) / "checkpoints" / "last.ckpt", weights_only=True)["callbacks"]
    assert stopping.state_key in states and not any(key.startswith("LastCheckpoint") for key in states)


def test_a_short_key_given_beats_the_listed_entry_and_the_saved_config_keeps_the_choice(tmp_path, caplog):
    (tmp_path / "callbacks.yaml").write_text(yaml.safe_dump(USER_CALLBACKS))
    with caplog.at_level("INFO"), pytest.raises(NonFiniteLossError, match="global step 1"):
        fit(tmp_path, "--config", str(tmp_path / "callbacks.yaml"), "--nan_guard.on_nonfinite", "raise",
            "--callbacks_off", "[norms]")  # given on the command line, though it is the default
    [line] = [line for line in info_lines(caplog) if "--nan_guard" in line]
    assert "which is given: --nan_guard is used, the listed one left out (its on_nonfinite='skip')" in line
    [saved] = tmp_path.rglob("config.yaml")
    listed = [entry["class_path"] for entry in yaml.safe_load(saved.read_text())["trainer"]["callbacks"]]
    assert not any(path.endswith("NonFiniteLossGuard") for path in listed) and len(listed) == 2

    # a short key a config file sets to other than its default is given too
    (tmp_path / "guard.yaml").write_text(yaml.safe_dump({"nan_guard": {"on_nonfinite": "skip"}, "trainer": {
        "callbacks": [{"class_path": "NonFiniteLossGuard", "init_args": {"on_nonfinite": "raise"}}]}}))
    trainer = cli.make_cli(["--config", str(QUICKSTART), "--config", str(tmp_path / "guard.yaml")], run=False).trainer
    assert [guard.on_nonfinite for guard in of_type(trainer.callbacks, NonFiniteLossGuard)] == ["skip"]


def test_the_tasks_monitor_fills_the_short_key_only():
    """A listed ModelCheckpoint without a monitor keeps none (Lightning's latest-checkpoint one) and runs beside
    the standard best and last checkpoints, whose identities differ from it."""
    trainer = cli.make_cli(["--config", str(QUICKSTART), "--trainer.callbacks+=ModelCheckpoint",
                            "--trainer.callbacks.every_n_train_steps=100"], run=False).trainer
    checkpoints = [cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)]
    assert sorted((type(cb).__name__, str(cb.monitor)) for cb in checkpoints) == [
        ("LastCheckpoint", "None"), ("ModelCheckpoint", "None"), ("ModelCheckpoint", "val/top1")]
    assert len({cb.state_key for cb in checkpoints}) == 3


def test_two_callbacks_writing_last_ckpt_are_an_error_when_both_are_given():
    with pytest.raises(ConfigError, match="both write checkpoints/last.ckpt"):
        cli.make_cli(["--config", str(QUICKSTART), "--checkpoint.save_last", "true",
                      "--last_checkpoint.every_n_train_steps", "50"], run=False)


def test_the_last_checkpoint_has_an_identity_of_its_own_and_reads_an_old_runs_state():
    last, users = LastCheckpoint(filename="last"), ModelCheckpoint()
    assert last.state_key != users.state_key and "'filename': 'last'" in last.state_key
    assert last.plain_state_key == users.state_key
    old = torch.load(OLD_RUN.with_name("last.ckpt"), weights_only=True)  # saved when it was a plain ModelCheckpoint
    state = old["callbacks"][last.plain_state_key]
    last.on_load_checkpoint(None, None, old)
    assert old["callbacks"][last.state_key] is state and state["best_model_path"].endswith("/checkpoints/last.ckpt")


def test_an_old_config_listing_standard_callbacks_runs_with_its_own_settings(tmp_path, caplog):
    old = {k: v for k, v in yaml.safe_load(OLD_RUN.read_text()).items() if k not in ("ckpt_path", "weights_only")}
    [guard] = [c for c in old["trainer"]["callbacks"] if c["class_path"].endswith("NonFiniteLossGuard")]
    guard["init_args"]["on_nonfinite"] = "skip"  # a setting that differs from --nan_guard's
    [norms] = [c for c in old["trainer"]["callbacks"] if c["class_path"].endswith("AttentionNorms")]
    norms["init_args"]["every_n_steps"] = 7
    old["trainer"]["callbacks"].append({"class_path": "ModelCheckpoint",
                                        "init_args": {"filename": "every100", "every_n_train_steps": 100}})
    old["trainer"]["logger"]["init_args"]["save_dir"] = str(tmp_path)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    with caplog.at_level("INFO"):
        run = cli.make_cli(["--config", str(tmp_path / "config.yaml")], run=False)
    lines = info_lines(caplog)
    named = {key for key in STANDARD_KEYS for line in lines if f"--{key}:" in line or f"--{key} is left" in line}
    assert named == set(STANDARD_KEYS) - {"preemption", "memory", "summary", "progress_lines"}, lines  # newer
    callbacks = run.trainer.callbacks
    assert [guard.on_nonfinite for guard in of_type(callbacks, NonFiniteLossGuard)] == ["skip"]
    assert [norms.every_n_steps for norms in of_type(callbacks, AttentionNorms)] == [7]
    assert len(of_type(callbacks, ExactResume)) == len(of_type(callbacks, StopOnSignal)) == 1
    filenames = sorted(cb.filename for cb in callbacks if isinstance(cb, ModelCheckpoint))
    assert filenames == ["best-epoch{epoch:03d}", "every100", "last"]  # the old run's two and the user's own third
    assert not of_type(callbacks, LastCheckpoint)  # the old run's plain last checkpoint writes last.ckpt
