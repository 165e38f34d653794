"""The grid's folder: grid.json and cell.json as written, a cell's state from its metrics.json (the end-of-fit file,
written here by the test as the fit writes it), its checkpoints and its attempts, and a second grid refused."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from training_helpers import QUICKSTART

from polyattn_lightning.errors import ConfigError
from polyattn_lightning.grids.folder import (
    FAILED,
    FINISHED,
    INTERRUPTED,
    NOT_STARTED,
    RUNNING,
    cell_dir,
    cell_state,
    end_attempt,
    job,
    newest_checkpoint,
    prepare,
    set_aside,
    start_attempt,
)
from polyattn_lightning.grids.spec import cells, read_grid


def write_grid(tmp_path: Path, seeds=(1, 2)) -> Path:
    path = tmp_path / "digits.yaml"
    path.write_text(yaml.safe_dump({
        "base": str(QUICKSTART),
        "args": {"trainer.max_steps": 2},
        "axes": {"attention": {"key": "model.init_args.attention", "values": ["softmax", "relu"]},
                 "seed": {"key": "seed_everything", "values": list(seeds), "label": "seed{}"}},
    }))
    return path


def metrics(directory: Path, status: str, **more) -> None:
    """``metrics.json`` as the end-of-fit callback writes it (SCHEMA_METRICS: schema 1)."""
    data = {"schema": 1, "status": status, "verb": "fit", "monitor": "val/top1", "mode": "max",
            "best": {"value": 0.5, "step": 2, "epoch": 0, "checkpoint": "checkpoints/best.ckpt"},
            "last": {"value": 0.5, "step": 2, "epoch": 0}, "metrics": {"val/top1": 0.5}, "chance": None,
            "at_chance": False, "steps": 2, "epochs": 1, "elapsed_s": 1.0, "config": "config.yaml", "error": None}
    (directory / "metrics.json").write_text(json.dumps({**data, **more}))


def checkpoint(path: Path, mtime: int | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": {"w": torch.ones(2)}, "global_step": 1}, path)
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


@pytest.fixture
def grid(tmp_path):
    spec = read_grid(write_grid(tmp_path))
    folder = tmp_path / "out"
    prepare(folder, spec, cells(spec))
    return spec, folder


def test_the_folder_holds_the_grid_and_one_record_per_cell(grid, tmp_path):
    spec, folder = grid
    assert (folder / "grid.yaml").read_text() == (tmp_path / "digits.yaml").read_text()
    record = json.loads((folder / "grid.json").read_text())
    assert record["name"] == "digits" and record["base"] == str(QUICKSTART.resolve())
    assert record["axes"][1] == {"name": "seed", "key": "seed_everything", "labels": ["seed1", "seed2"],
                                 "values": [1, 2]}
    assert record["cells"][3] == {"name": "relu/seed2", "labels": {"attention": "relu", "seed": "seed2"},
                                  "settings": {"model.init_args.attention": "relu", "seed_everything": 2},
                                  "dir": "cells/relu/seed2"}
    cell = json.loads((folder / "cells" / "relu" / "seed2" / "cell.json").read_text())
    assert cell["attempts"] == 0 and cell["log"] == "cell.log"
    assert "--model.init_args.attention=relu" in cell["command"] and "--seed_everything=2" in cell["command"]


def test_a_rerun_keeps_the_attempts_and_another_grid_is_refused_untouched(grid, tmp_path):
    spec, folder = grid
    directory = cell_dir(folder, cells(spec)[0])
    start_attempt(directory, ["python"], None, pid=1)
    prepare(folder, spec, cells(spec))  # the same grid again
    assert json.loads((directory / "cell.json").read_text())["attempts"] == 1
    before = {path: path.read_bytes() for path in folder.rglob("*") if path.is_file()}
    other = read_grid(write_grid(tmp_path, seeds=(1, 2, 3)))
    with pytest.raises(ConfigError) as error:
        prepare(folder, other, cells(other))
    assert str(error.value) == (
        f"{folder} holds another grid (its axis seed has other labels: seed1, seed2): nothing was changed; give this grid another folder "
        f"(--out DIR), or delete {folder}"
    )
    assert {path: path.read_bytes() for path in folder.rglob("*") if path.is_file()} == before


def test_a_folder_with_other_files_is_refused(tmp_path):
    spec = read_grid(write_grid(tmp_path))
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"busy is not empty and holds no grid\.json"):
        prepare(tmp_path / "busy", spec, cells(spec))


def test_states_from_metrics_checkpoints_and_attempts(grid):
    spec, folder = grid
    directory = cell_dir(folder, cells(spec)[0])
    assert cell_state(directory).state == NOT_STARTED
    # a process that ended by Ctrl-C after writing a checkpoint, before the fit wrote its metrics
    start_attempt(directory, ["python"], None, pid=123456789)
    last = checkpoint(directory / "checkpoints" / "last.ckpt", mtime=2_000_000_000)
    checkpoint(directory / "checkpoints" / "best-epoch000.ckpt", mtime=1_000_000_000)
    end_attempt(directory, 130)
    state = cell_state(directory)
    assert (state.state, state.checkpoint) == (INTERRUPTED, last)
    metrics(directory, "interrupted")
    assert cell_state(directory).checkpoint == last
    planned = job(spec, folder, cells(spec)[0], cell_state(directory))
    assert planned.argv[-1] == f"--ckpt_path={last.absolute()}" and planned.resumed_from == last.absolute()
    metrics(directory, "finished")
    assert cell_state(directory).state == FINISHED
    assert job(spec, folder, cells(spec)[0], cell_state(directory)) is None
    metrics(directory, "failed", error="ValueError: loss is nan")
    assert (cell_state(directory).state, cell_state(directory).detail) == (FAILED, "failed: ValueError: loss is nan")


def test_a_nonzero_exit_without_metrics_is_failed_and_a_zero_one_too(grid):
    spec, folder = grid
    directory = cell_dir(folder, cells(spec)[1])
    start_attempt(directory, ["python"], None, pid=123456789)
    checkpoint(directory / "checkpoints" / "last.ckpt")
    end_attempt(directory, 1)
    assert (cell_state(directory).state, cell_state(directory).detail) == (FAILED, "exited with status 1")
    end_attempt(directory, 0)
    assert cell_state(directory).detail == "ended without writing metrics.json"


def test_a_torn_or_temporary_checkpoint_is_not_resumed_from(grid):
    spec, folder = grid
    directory = cell_dir(folder, cells(spec)[2])
    good = checkpoint(directory / "checkpoints" / "best.ckpt", mtime=1_000_000_000)
    torn = checkpoint(directory / "checkpoints" / "last.ckpt", mtime=2_000_000_000)
    torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])
    os.utime(torn, (2_000_000_000, 2_000_000_000))
    checkpoint(directory / "checkpoints" / ".last.ckpt.1234abcd.tmp", mtime=3_000_000_000)
    assert newest_checkpoint(directory) == good
    hpc = checkpoint(directory / "hpc_ckpt_2.ckpt", mtime=2_500_000_000)  # SLURM's requeue checkpoint
    assert newest_checkpoint(directory) == hpc


def test_a_cell_a_live_process_trains_is_running_and_a_lost_one_is_not(grid):
    spec, folder = grid
    directory = cell_dir(folder, cells(spec)[3])
    child = "import time; print('started', flush=True); time.sleep(60)"
    process = subprocess.Popen([sys.executable, "-c", child, "polyattn_lightning"], stdout=subprocess.PIPE, text=True)
    try:
        process.stdout.readline()  # the child runs: its /proc cmdline reads empty for a moment after the spawn
        start_attempt(directory, ["python"], None, pid=process.pid)
        assert cell_state(directory).state == RUNNING
    finally:
        process.kill()
        process.communicate()
    state = cell_state(directory)  # lost: no exit recorded (the grid was killed), no checkpoint
    assert (state.state, state.detail) == (NOT_STARTED, "stopped before its first checkpoint: starts again")


def test_a_failed_attempt_is_set_aside_whole(grid):
    spec, folder = grid
    directory = cell_dir(folder, cells(spec)[0])
    checkpoint(directory / "checkpoints" / "last.ckpt")
    metrics(directory, "failed")
    (directory / "cell.log").write_text("attempt 1\n")
    aside = set_aside(directory)
    assert aside == directory / "failed-1"
    assert sorted(p.name for p in directory.iterdir()) == ["cell.json", "cell.log", "failed-1"]
    assert (aside / "checkpoints" / "last.ckpt").is_file() and (aside / "metrics.json").is_file()
    assert cell_state(directory).state == NOT_STARTED
    metrics(directory, "failed")
    assert set_aside(directory) == directory / "failed-2"
