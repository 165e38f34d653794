"""The local launcher's bookkeeping with scripted cell processes (``scripted_cell.py``): at most N at a time with
their threads shared out, a failed cell's last log lines with the others going on, Ctrl-C forwarded once to the
running cells (none started after it), a second Ctrl-C killing them. The launcher runs in its own process, as the
grid command does, so that the test can send it SIGINT."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from polyattn_lightning.grids.folder import FAILED, FINISHED, INTERRUPTED, cell_state

SCRIPT = Path(__file__).with_name("scripted_cell.py")
DRIVER = """
import json, sys
from pathlib import Path
from polyattn_lightning.grids.folder import GridLog, Job
from polyattn_lightning.grids.local import launch
from polyattn_lightning.grids.spec import Cell

root, parallel, script = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
jobs = []
for spec in sys.argv[4:]:
    name, mode = spec.split("=")
    directory = root / "cells" / name
    directory.mkdir(parents=True)
    argv = [sys.executable, script, mode, str(directory), str(root / "running")]
    jobs.append(Job(Cell(name, {}, {}), directory, argv))
launched = launch(jobs, GridLog(root), {"parallel": parallel})
print("RESULT " + json.dumps({"stopped": launched.stopped, "states": {n: s.state for n, s in launched.states.items()}}))
"""


def start_grid(tmp_path: Path, parallel: int, *cells: str) -> subprocess.Popen:
    (tmp_path / "running").mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path), str(parallel), str(SCRIPT), *cells],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def result(process: subprocess.Popen, timeout: float = 300) -> tuple[int, dict, str]:
    output = process.communicate(timeout=timeout)[0]
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    return process.returncode, json.loads(lines[0][7:]) if lines else {}, output


def wait_for(paths: list[Path], text: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not all(path.is_file() and text in path.read_text() for path in paths):
        assert time.monotonic() < deadline, f"no {text!r} in {paths}"
        time.sleep(0.1)


def test_at_most_n_cells_run_at_a_time_with_their_share_of_the_threads(tmp_path):
    code, found, output = result(start_grid(tmp_path, 2, "a=finish", "b=finish", "c=finish", "d=finish"))
    assert code == 0, output
    assert found == {"stopped": False, "states": dict.fromkeys("abcd", FINISHED)}
    seen = [json.loads((tmp_path / "cells" / name / "seen.json").read_text()) for name in "abcd"]
    assert max(entry["beside"] for entry in seen) == 2
    cores = len(os.sched_getaffinity(0))
    assert {entry["threads"] for entry in seen} == {str(max(1, cores // 2))}
    log = (tmp_path / "grid.log").read_text()
    for name in "abcd":
        assert f"started {name} (attempt 1, starting; log " in log and f"finished {name} in " in log
        record = json.loads((tmp_path / "cells" / name / "cell.json").read_text())
        assert record["attempts"] == 1 and record["runs"][0]["exit"] == 0


def test_a_failed_cell_shows_its_last_lines_and_the_others_go_on(tmp_path):
    code, found, output = result(start_grid(tmp_path, 1, "bad=fail", "good=finish"))
    assert code == 0, output
    assert found["states"] == {"bad": FAILED, "good": FINISHED}
    assert "FAILED bad after " in output and ": exited with status 3; its log ends:\n" in output
    tail = output.split("its log ends:\n")[1].splitlines()[:12]
    assert tail == [f"    fail line {index}" for index in range(8, 20)]
    assert "fail line 19" in (tmp_path / "grid.log").read_text()  # the terminal's lines are in grid.log too


def test_ctrl_c_reaches_each_running_cell_once_and_starts_no_other(tmp_path):
    grid = start_grid(tmp_path, 2, "a=train", "b=train", "c=finish")
    wait_for([tmp_path / "cells" / name / "cell.log" for name in "ab"], "ready")
    grid.send_signal(signal.SIGINT)
    code, found, output = result(grid)
    assert code == 0, output  # the driver returns; `polyattn grid` exits 130 (test_grid_command)
    assert found == {"stopped": True, "states": {"a": INTERRUPTED, "b": INTERRUPTED}}
    assert "Ctrl-C: no new cells; the 2 running cells save a checkpoint at their next step and stop" in output
    for name in "ab":
        state = cell_state(tmp_path / "cells" / name)
        assert (state.state, state.checkpoint.name) == (INTERRUPTED, "last.ckpt")
        assert json.loads((tmp_path / "cells" / name / "cell.json").read_text())["runs"][0]["exit"] == 130
    assert not (tmp_path / "cells" / "c" / "cell.json").exists()  # never started


def test_a_second_ctrl_c_kills_the_running_cells(tmp_path):
    grid = start_grid(tmp_path, 1, "a=stubborn")
    wait_for([tmp_path / "cells" / "a" / "cell.log"], "ready")
    grid.send_signal(signal.SIGINT)
    time.sleep(1)  # the launcher acts on a Ctrl-C within a fraction of a second; two at once also kill
    grid.send_signal(signal.SIGINT)
    code, found, output = result(grid)
    assert "Ctrl-C again: killing 1 running cells (their newest complete checkpoints stay)" in output
    assert found["states"] == {"a": INTERRUPTED}
    assert json.loads((tmp_path / "cells" / "a" / "cell.json").read_text())["runs"][0]["exit"] == -signal.SIGKILL
    assert not (tmp_path / "cells" / "a" / "metrics.json").exists()


@pytest.mark.parametrize("line", ["Epoch 3: 40%|####      | 4/10", "fit: writing logs"])
def test_the_heartbeat_shows_the_last_line_of_a_progress_bar(tmp_path, line):
    from polyattn_lightning.grids.local import last_lines

    log = tmp_path / "cell.log"
    log.write_text(f"first\n\rEpoch 3: 10%|#  | 1/10\r{line}\n\n")
    assert last_lines(log, 1) == [line]
