"""Ctrl-C in ``polyattn fit`` as a user meets it (each command its own process, ``cli_driver.py``; the Ctrl-C is a
real SIGINT the run sends itself mid-step): exit status 130, one line naming the checkpoint and the command that
resumes; that command continues in the same run folder without a warning about it and ends where the uninterrupted
run ends, bit for bit; a second Ctrl-C stops at once, without a checkpoint, also with status 130."""

from __future__ import annotations

import json
import shlex
import signal
from pathlib import Path

import torch
from test_first_hour import project, run  # noqa: F401  (the fixture)
from test_resume import assert_identical

#: 12 training images in batches of 4: 3 steps an epoch. The Ctrl-C comes in step 5, the last of epoch 1.
SHORT = ["--trainer.max_epochs", "3", "--trainer.deterministic", "true", "--trainer.enable_progress_bar", "false"]
RUNS = Path("runs") / "classification" / "folder"


def ctrl_c(times: int = 1) -> str:
    """The option that makes the run send itself SIGINT (``times`` in a row) after the backward of step 5."""
    spec = {
        "class_path": "preemption_worker.SendSignal",
        "init_args": {"where": "mid_step", "signum": int(signal.SIGINT), "times": times},
    }
    return f"--trainer.callbacks+={json.dumps(spec)}"


def final_state(path: Path) -> dict:
    checkpoint = torch.load(path, weights_only=True)
    return {
        key: checkpoint[key] for key in ("global_step", "state_dict", "optimizer_states", "lr_schedulers", "rng_states")
    }


def test_ctrl_c_saves_says_how_to_resume_and_the_resumed_run_continues_in_its_folder(project):  # noqa: F811
    fit = ["fit", "--config", "folder.yaml", *SHORT]
    reference, stopped, insisted = run(project, fit, [*fit, ctrl_c()], [*fit, ctrl_c(times=2)])
    fit.append(ctrl_c())  # the stopped run's command, which the resume command repeats (step 5 is not trained again)
    assert reference["rc"] == 0, reference["output"]

    assert stopped["rc"] == 130, stopped["output"]
    output, ckpt = stopped["output"], str(RUNS / "version_1" / "checkpoints" / "last.ckpt")
    assert "Ctrl-C: stopping at the end of this training step, after writing a checkpoint" in output
    [line] = [line for line in output.splitlines() if line.startswith("Ctrl-C: saved")]
    # step 5 is followed by epoch 1's validation: the checkpoint is taken in it, and it runs again on resume
    assert line == (
        f"Ctrl-C: saved {ckpt} at step 6 (the validation it cut short runs again first); resume with: "
        f"polyattn {shlex.join([*fit, '--ckpt_path', ckpt])}"
    )
    assert "Traceback" not in output and "graceful shutdown" not in output

    assert insisted["rc"] == 130, insisted["output"]
    assert "Ctrl-C again: stopping now; no checkpoint written; the newest is " in insisted["output"]
    assert "Ctrl-C: saved" not in insisted["output"]

    [resumed] = run(project, shlex.split(line.split("resume with: ", 1)[1])[1:])
    output = resumed["output"]
    assert resumed["rc"] == 0, output
    assert f"fit: resuming {ckpt}: logs, config and checkpoints/ go on in {RUNS / 'version_1'}" in output
    assert "dirpath has changed" not in output and "exists and is not empty" not in output, output
    warnings = [line for line in output.splitlines() if ".py:" in line and "checkpoint" in line.lower()]
    assert not warnings, warnings  # Lightning's warnings read "<file>.py:<line>: <message>"
    assert sorted(path.name for path in (project / RUNS).iterdir()) == ["version_0", "version_1", "version_2"]
    assert (project / RUNS / "version_1" / "config.1.yaml").is_file()  # the resumed run's config, beside the first
    assert_identical(
        final_state(project / ckpt), final_state(project / RUNS / "version_0" / "checkpoints" / "last.ckpt"), "resumed"
    )
