"""``polyattn grid --launcher slurm`` on a real SLURM (the private one of ``tests/cluster/slurm_cluster.py``).

A grid of 6 tiny digits fits (2 activations x 3 seeds, 30 steps each) is submitted by the grid command as one job
array through submitit, 2 tasks at a time on the 2-CPU node. The two cells first started hold at step :data:`HOLD_AT`
(``grid_hold.HoldOnce``) while the test has SLURM stop them: one is cancelled (``scancel``), the other preempted
(``scancel --signal=USR2``, the signal submitit's sbatch script asks for before a time limit). On either signal the
project's ``StopOnSignal`` saves ``hpc_ckpt_1.ckpt`` at the step's end; the preempted task is requeued by SLURM's own
``scontrol requeue``, restarted by SLURM and resumes from it within the same run; the cancelled cell is not finished,
and the grid command run again submits only that cell, which resumes from its checkpoint. Every cell then trained
each of its steps exactly once (the steps each attempt ran, and the attempts of ``cell.json`` and ``cell.log``), and
``polyattn grid report`` agrees with every cell's own ``metrics.json``.
``--dry-run --launcher slurm`` shows the array's sbatch script without a cluster or a submission.
"""

from __future__ import annotations

import csv
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from slurm_cluster import SlurmCluster
from training_helpers import QUICKSTART

from polyattn_lightning import cli

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter is intended")
ROOT = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parent
STEPS, HOLD_AT = 30, 12
TIMEOUT = 900  # seconds, for each grid command: a few minutes of work on the loaded 2-core machine
NAMES = [f"{attention}/seed{seed}" for attention in ("softmax", "poly3") for seed in (1, 2, 3)]


def write_grid(folder: Path, hold: Path) -> Path:
    args = {
        "trainer.max_steps": STEPS,
        "trainer.val_check_interval": 10,
        "trainer.limit_val_batches": 2,
        "trainer.enable_progress_bar": False,
        "model.init_args.model_kwargs": {"patch_size": 4, "embed_dim": 16, "depth": 1, "num_heads": 2},
        "trainer.callbacks+": {
            "class_path": "grid_hold.HoldOnce",
            "init_args": {"folder": str(hold), "hold_at": HOLD_AT},
        },
    }
    grid = {
        "name": "digits-slurm",
        "base": str(QUICKSTART),
        "args": args,
        "axes": {
            "attention": {"key": "model.init_args.attention", "values": {"softmax": "softmax", "poly3": "poly3"}},
            "seed": {"key": "seed_everything", "values": [1, 2, 3], "label": "seed{}"},
        },
        "launcher": {"slurm": {"partition": "debug", "timeout_min": 20, "cpus_per_task": 1, "array_parallelism": 2}},
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "grid.yaml"
    path.write_text(yaml.safe_dump(grid, sort_keys=False))
    return path


def grid_command(slurm: SlurmCluster, *args: str) -> subprocess.Popen:
    env = slurm.environ()
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(TESTS)])  # the hold callback, in the tasks too
    return subprocess.Popen(
        [sys.executable, "-m", "polyattn_lightning", "grid", *map(str, args)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def cell_record(folder: Path, name: str) -> dict:
    return json.loads((folder / "cells" / name / "cell.json").read_text())


def metrics(folder: Path, name: str) -> dict:
    return json.loads((folder / "cells" / name / "metrics.json").read_text())


def steps(folder: Path, name: str) -> list[int]:
    return [int(line) for line in (folder / "cells" / name / "steps.txt").read_text().split()]


@pytest.fixture(scope="module")
def grid(slurm_cluster, tmp_path_factory) -> dict:
    """The grid run with two running tasks stopped midway by SLURM (one cancelled, one preempted and requeued), then
    run again: the folder, the two cells and their tasks, and both commands' exit status and output."""
    slurm = slurm_cluster
    root = tmp_path_factory.mktemp("slurm-grid")
    hold, folder = root / "hold", root / "out"
    path = write_grid(root, hold)
    first = grid_command(slurm, path, "--launcher", "slurm", "--out", folder)
    second = None

    def two_held() -> list[Path]:
        assert first.poll() is None, first.communicate()[0]
        markers = sorted(hold.glob("held-*"))
        return markers if len(markers) >= 2 else []

    def restarts(task: str) -> str:
        return slurm.job(task)["Restarts"]

    try:
        markers = slurm.wait_until(f"the first two cells to hold at their step {HOLD_AT}", two_held, TIMEOUT)
        cancelled, preempted = (Path(m.read_text()).relative_to(folder / "cells").as_posix() for m in markers[:2])
        tasks = {name: cell_record(folder, name)["runs"][-1]["slurm_job"] for name in (cancelled, preempted)}
        slurm.say(f"cancelling array task {tasks[cancelled]} ({cancelled}) with scancel")
        slurm.run("scancel", tasks[cancelled])
        slurm.say(f"preempting array task {tasks[preempted]} ({preempted}) with scancel --signal=USR2")
        # the task requeues itself before slurmctld answers the signal's request, which then says "Job can not be
        # altered now, try again later", and scancel keeps trying: it is stopped once the task is requeued
        preempting = subprocess.Popen(
            ["scancel", "--signal=USR2", tasks[preempted]], env=slurm.environ(), stdout=subprocess.DEVNULL
        )
        slurm.wait_until(
            f"task {tasks[cancelled]} to be cancelled",
            lambda: slurm.job(tasks[cancelled])["JobState"] == "CANCELLED",
            300,
        )
        slurm.wait_until(f"task {tasks[preempted]} to be requeued", lambda: restarts(tasks[preempted]) == "1", 300)
        if preempting.poll() is None:
            preempting.terminate()
        preempting.wait()
        (hold / "release").write_text("")  # the other cells go on, and none holds again
        first_output = first.communicate(timeout=TIMEOUT)[0]
        second = grid_command(slurm, path, "--launcher", "slurm", "--out", folder)
        second_output = second.communicate(timeout=TIMEOUT)[0]
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.kill()
    return {
        "folder": folder,
        "cancelled": cancelled,
        "preempted": preempted,
        "tasks": tasks,
        "first": (first.returncode, first_output),
        "second": (second.returncode, second_output),
    }


@pytest.mark.slow
def test_the_array_goes_through_submitit_and_only_the_cancelled_cell_is_submitted_again(grid):
    cancelled, preempted, tasks = grid["cancelled"], grid["preempted"], grid["tasks"]
    code, output = grid["first"]
    assert code == 0, output
    assert "submitting 6 cells as one SLURM job array through submitit:" in output
    assert "--array=0-5%2" in output and "--signal=USR2@90" in output and "--requeue" in output
    assert re.search(r"SLURM job \d+: [0-6] queued, [0-2] running, waiting for [1-6] tasks", output), output
    interrupted = rf"^interrupted {re.escape(cancelled)} \(task {tasks[cancelled]}, CANCELLED\): was interrupted; "
    assert re.search(interrupted + r"resumes from hpc_ckpt_1\.ckpt$", output, re.MULTILINE), output
    assert f"finished {preempted} (task {tasks[preempted]}) " in output  # requeued by SLURM, within this run
    assert "grid digits-slurm: 5 done, 0 failed, 0 skipped, 1 interrupted" in output
    code, output = grid["second"]
    assert code == 0, output
    assert (
        "submitting 1 cell as one SLURM job through submitit:" in output
        and "--array" not in output.split("submitting 1 cell")[1]
    )
    assert f"finished {cancelled} (task " in output
    assert "grid digits-slurm: 1 done, 0 failed, 5 skipped" in output


@pytest.mark.slow
def test_every_cell_is_trained_exactly_once_and_the_stopped_ones_resume_from_their_checkpoint(grid):
    folder, cancelled, preempted, tasks = grid["folder"], grid["cancelled"], grid["preempted"], grid["tasks"]
    for name in NAMES:
        assert metrics(folder, name)["status"] == "finished" and metrics(folder, name)["steps"] == STEPS, name
        assert steps(folder, name) == list(range(STEPS)), name  # every step once, over all attempts
        runs = cell_record(folder, name)["runs"]
        log = (folder / "cells" / name / "cell.log").read_text()
        headers = re.findall(r"^==== \S+ grid: (starting|resuming from \S+): polyattn fit ", log, re.MULTILINE)
        if name not in (cancelled, preempted):
            assert [(run["attempt"], run["exit"], run["resumed_from"]) for run in runs] == [(1, 0, None)], name
            assert headers == ["starting"], name
            continue
        # stopped by SLURM at the step it held at: the checkpoint StopOnSignal wrote there, then one resumed attempt
        checkpoint = folder / "cells" / name / "hpc_ckpt_1.ckpt"
        assert [run["resumed_from"] for run in runs] == [None, str(checkpoint)], name
        assert headers == ["starting", f"resuming from {checkpoint}"], name
        assert re.search(rf"saved \S*hpc_ckpt_1\.ckpt at step {HOLD_AT} ", log), log[-3000:]
        assert runs[0]["slurm_job"] == tasks[name]
        if name == cancelled:  # run again by the second grid command: a task of another array
            assert runs[1]["slurm_job"] != tasks[name] and runs[1]["restart"] == 0
        else:  # requeued by SLURM: the same task, restarted, with the same pickled call
            assert f"requeued SLURM job {tasks[name]}" in log
            assert [(run["slurm_job"], run["restart"]) for run in runs] == [(tasks[name], 0), (tasks[name], 1)]


@pytest.mark.slow
def test_the_report_matches_every_cells_own_metrics_file(grid):
    folder = grid["folder"]
    result = subprocess.run(
        [sys.executable, "-m", "polyattn_lightning", "grid", "report", str(folder)],
        check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    with open(folder / "report" / "cells.csv", newline="") as file:
        rows = {row["cell"]: row for row in csv.DictReader(file)}
    assert sorted(rows) == sorted(NAMES)
    for name in NAMES:
        assert rows[name]["status"] == "finished"
        assert float(rows[name]["value"]) == metrics(folder, name)["best"]["value"], name
    with open(folder / "report" / "table.csv", newline="") as file:
        groups = {row["attention"]: row for row in csv.DictReader(file)}
    for attention in ("softmax", "poly3"):  # each group's mean over its three seeds' own values
        values = [metrics(folder, f"{attention}/seed{seed}")["best"]["value"] for seed in (1, 2, 3)]
        assert groups[attention]["n"] == "3"
        assert float(groups[attention]["mean"]) == pytest.approx(statistics.mean(values), rel=1e-12)


def test_dry_run_shows_the_arrays_sbatch_script_and_submits_nothing(tmp_path, capsys):
    path = write_grid(tmp_path, tmp_path / "hold")
    cli.main(["grid", str(path), "--dry-run", "--launcher", "slurm", "--parallel", "3", "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"grid digits-slurm: 6 cells in {tmp_path / 'out'} (a new folder)"
    start = out.index("--launcher slurm: 6 cells as one SLURM job array through submitit; its sbatch script:")
    script = [line.strip() for line in out[start + 1 :]]
    for flag in (
        "--array=0-5%3",
        "--partition=debug",
        "--time=20",
        "--cpus-per-task=1",
        "--signal=USR2@90",
        "--requeue",
        "--job-name=grid-out",
    ):
        assert f"#SBATCH {flag}" in script, (flag, script)
    assert any(line.startswith("srun ") and "submitit.core._submit" in line for line in script), script
    assert script[-1] == (
        "each task: the cell's fit in the task's process, with "
        "--trainer.plugins+=SLURMEnvironment(requeue_signal=SIGUSR2)"
    )
    assert not (tmp_path / "out").exists()


def test_a_setting_submitit_does_not_take_is_one_line_naming_the_closest(tmp_path, capsys):
    path = write_grid(tmp_path, tmp_path / "hold")
    grid = yaml.safe_load(path.read_text())
    grid["launcher"]["slurm"]["cpus_per_tsk"] = 2
    path.write_text(yaml.safe_dump(grid))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["grid", str(path), "--dry-run", "--launcher", "slurm", "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.splitlines()[0]
    assert error.startswith(
        "error: launcher.slurm: unknown key cpus_per_tsk (did you mean cpus_per_task?); "
        "submitit takes cpus_per_task, gpus_per_node, mem_gb, name, nodes, "
    ), error


@pytest.mark.slow
def test_a_rerun_waits_for_a_cells_task_slurm_still_runs_instead_of_submitting_it_again(slurm, tmp_path):
    from polyattn_lightning.grids.folder import GridLog, cell_dir, cell_state, job, prepare
    from polyattn_lightning.grids.slurm import SlurmLauncher, note_submission
    from polyattn_lightning.grids.spec import cells, read_grid

    path = write_grid(tmp_path, tmp_path / "hold")
    spec, folder = read_grid(path), tmp_path / "out"
    prepare(folder, spec, cells(spec))
    cell = cells(spec)[0]
    running = slurm.sbatch("--wrap", "sleep 300", "--cpus-per-task=1", "--time=10", cwd=tmp_path)
    note_submission(cell_dir(folder, cell), running)  # as a grid command that was killed would have left it
    launcher = SlurmLauncher(GridLog(folder), {"partition": "debug", "timeout_min": 10, "parallel": 1})
    planned = job(spec, folder, cell, cell_state(cell_dir(folder, cell)))
    try:
        task = launcher._live_task(planned)
        assert task is not None and task.job_id == running and task.state in ("PENDING", "RUNNING")
    finally:
        slurm.run("scancel", running)
    assert slurm.wait_for_job(running, 120)["JobState"] == "CANCELLED"
    assert launcher._live_task(planned) is None  # ended: a rerun submits the cell
