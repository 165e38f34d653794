"""``polyattn grid`` on the digits quickstart: the dry-run listing of each cell's state and command, and end to end
(real fits, 2 x 2 cells, 2 at a time): all finished and skipped on a rerun; stopped by Ctrl-C midway and run again,
every cell trained exactly once and the resumed cells equal to uninterrupted ones; a failing cell reported with its
last log lines while the others finish.

The end-to-end tests read each cell's ``metrics.json``, written by the fit itself at its end (``RunSummary``)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from training_helpers import QUICKSTART

from polyattn_lightning import cli
from polyattn_lightning.grids.folder import cell_dir, end_attempt, prepare, start_attempt
from polyattn_lightning.grids.spec import cells, read_grid

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter is intended")

ROOT = Path(__file__).resolve().parents[2]
#: A tiny digits ViT: 150 steps (an epoch is 44), validated and checkpointed every 10.
TINY = {
    "trainer.max_steps": 150,
    "trainer.val_check_interval": 10,
    "trainer.limit_val_batches": 2,
    "trainer.enable_progress_bar": False,
    "model.init_args.model_kwargs": {"patch_size": 4, "embed_dim": 16, "depth": 1, "num_heads": 2},
}
AXES = {
    "attention": {"key": "model.init_args.attention",
                  "values": {"softmax": "softmax", "poly3-scaled": {"name": "poly3", "scale": "inv_sqrt_n"}}},
    "seed": {"key": "seed_everything", "values": [1, 2], "label": "seed{}"},
}
NAMES = ["softmax/seed1", "softmax/seed2", "poly3-scaled/seed1", "poly3-scaled/seed2"]


def write_grid(folder: Path, args=None, axes=None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "digits.yaml"
    path.write_text(yaml.safe_dump({"name": "digits", "base": str(QUICKSTART), "args": args or TINY,
                                    "axes": axes or AXES}, sort_keys=False))
    return path


def grid_process(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "polyattn_lightning", "grid", *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen) -> str:
    """The grid's output once it ends; past an hour (a stuck run, not a slow one) it is stopped as a user would:
    Ctrl-C, then Ctrl-C again, which kills its cells."""
    try:
        return process.communicate(timeout=3600)[0]
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGINT)
        time.sleep(1)
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=120)
        raise


def run_grid(*args: str) -> tuple[int, str]:
    process = grid_process(*args)
    output = finish(process)
    return process.returncode, output


def weights(cell: Path) -> dict[str, torch.Tensor]:
    return torch.load(cell / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]


def starts(cell: Path) -> tuple[int, int]:
    """(attempts started from scratch, attempts resumed) as the cell's log headers say."""
    log = (cell / "cell.log").read_text()
    return len(re.findall(r"^==== \S+ grid: starting: ", log, re.M)), len(re.findall(r"^==== \S+ grid: resuming ", log, re.M))


@pytest.fixture(scope="module")
def finished_grid(tmp_path_factory) -> tuple[Path, Path, int, str]:
    """The 2 x 2 grid run to its end, 2 cells at a time: (grid file, folder, exit status, output)."""
    root = tmp_path_factory.mktemp("finished")
    path = write_grid(root)
    code, output = run_grid(path, "--parallel", "2", "--out", root / "out")
    return path, root / "out", code, output


def test_dry_run_lists_each_cells_state_and_command_and_writes_nothing(tmp_path, capsys):
    path = write_grid(tmp_path)
    cli.main(["grid", str(path), "--dry-run", "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"grid digits: 4 cells in {tmp_path / 'out'} (a new folder)"
    assert out[1::2] == [f"{name}: not started -> start" for name in NAMES]
    assert "--model.init_args.attention=softmax --seed_everything=2 " in out[4]
    assert not (tmp_path / "out").exists()
    # a folder with a finished, an interrupted, a failed and a lost cell
    spec = read_grid(path)
    prepare(tmp_path / "out", spec, cells(spec))
    finished, interrupted, failed, lost = (cell_dir(tmp_path / "out", cell) for cell in cells(spec))
    (finished / "metrics.json").write_text(json.dumps({"schema": 1, "status": "finished", "steps": 150}))
    (interrupted / "checkpoints").mkdir()
    torch.save({"state_dict": {}}, interrupted / "checkpoints" / "last.ckpt")
    (interrupted / "metrics.json").write_text(json.dumps({"schema": 1, "status": "interrupted"}))
    (failed / "metrics.json").write_text(json.dumps({"schema": 1, "status": "failed", "error": "ValueError: nan"}))
    start_attempt(lost, ["python"], None, pid=2**22 + 1)
    end_attempt(lost, -signal.SIGKILL)
    cli.main(["grid", str(path), "--dry-run", "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out.splitlines()
    assert out[1:3] == ["softmax/seed1: finished (finished at step 150) -> skip",
                        "softmax/seed2: interrupted (was interrupted; resumes from checkpoints/last.ckpt) -> resume"]
    assert out[3].endswith(f" --ckpt_path={(interrupted / 'checkpoints' / 'last.ckpt').absolute()}")
    assert out[4] == "poly3-scaled/seed1: failed (failed: ValueError: nan) -> start again"
    assert out[6] == "poly3-scaled/seed2: not started (stopped before its first checkpoint: starts again) -> start"


def test_every_cell_finishes_and_a_rerun_skips_them_all(finished_grid):
    path, folder, code, output = finished_grid
    assert code == 0, output
    assert "grid digits: 4 done, 0 failed, 0 skipped" in output
    for name in NAMES:
        metrics = json.loads((folder / "cells" / name / "metrics.json").read_text())
        assert metrics["status"] == "finished" and metrics["steps"] == 150
        assert (folder / "cells" / name / "config.yaml").is_file()  # the fit's own run folder
    code, output = run_grid(path, "--parallel", "2", "--out", folder)
    assert code == 0, output
    assert "grid digits: 0 done, 0 failed, 4 skipped" in output
    assert [starts(folder / "cells" / name) for name in NAMES] == [(1, 0)] * 4


def test_ctrl_c_midway_then_a_rerun_trains_every_cell_once_and_resumed_cells_end_as_uninterrupted(
    finished_grid, tmp_path
):
    reference = finished_grid[1]
    path, folder = write_grid(tmp_path), tmp_path / "out"
    grid = grid_process(path, "--parallel", "2", "--out", folder)
    first = [folder / "cells" / name / "checkpoints" / "last.ckpt" for name in NAMES[:2]]
    while not all(ckpt.is_file() for ckpt in first):  # both running cells past their first checkpoint
        assert grid.poll() is None, grid.communicate()[0]
        time.sleep(0.1)
    grid.send_signal(signal.SIGINT)
    output = finish(grid)
    assert grid.returncode == 130, output
    assert f"stopped by Ctrl-C; to go on, run again: polyattn grid {path} --out {folder} --parallel 2" in output
    interrupted = [name for name in NAMES[:2] if json.loads((folder / "cells" / name / "metrics.json").read_text())
                   ["status"] == "interrupted"]
    assert interrupted, output  # Ctrl-C came mid-training
    code, output = run_grid(path, "--parallel", "2", "--out", folder)
    assert code == 0, output
    for name in NAMES:
        cell = folder / "cells" / name
        assert starts(cell) == (1, 1 if name in interrupted else 0), name
        record = json.loads((cell / "cell.json").read_text())
        assert record["attempts"] == sum(starts(cell))
        assert json.loads((cell / "metrics.json").read_text())["status"] == "finished"
        resumed, uninterrupted = weights(cell), weights(reference / "cells" / name)
        assert resumed.keys() == uninterrupted.keys()
        assert all(torch.equal(resumed[key], uninterrupted[key]) for key in resumed), name


def test_a_failing_cell_is_reported_with_its_last_log_lines_and_the_others_finish(tmp_path):
    axes = {"interval": {"key": "trainer.val_check_interval", "values": [10, 1000], "label": "val{}"}}
    args = {key: value for key, value in TINY.items() if key != "trainer.val_check_interval"}
    path = write_grid(tmp_path, args={**args, "trainer.max_steps": 20}, axes=axes)
    code, output = run_grid(path, "--parallel", "2", "--out", tmp_path / "out")
    assert code == 1, output
    assert re.search(r"FAILED val1000 after \S+: (exited with status 1|failed: .*); its log ends:\n(    .*\n){1,12}", output)
    assert "must be less than or equal to the number of the training batches" in output
    assert "grid digits: 1 done, 1 failed, 0 skipped" in output
    assert json.loads((tmp_path / "out" / "cells" / "val10" / "metrics.json").read_text())["status"] == "finished"


def test_report_of_a_folder_that_holds_no_grid_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["grid", "report", str(tmp_path)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[0] == (
        f"error: {tmp_path}: no grid.json: expected the folder of a grid `polyattn grid` ran"
    )
