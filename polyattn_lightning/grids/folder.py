"""A grid's folder: what it holds, the record of every cell's attempts, and each cell's state read from its files.

::

    <out>/                    default runs/grids/<name>/
      grid.yaml               the grid file as given (copied once)
      grid.json               the resolved grid: axes, report settings, cells with their settings and folders
      grid.log                what the launcher did, as the terminal showed it, with times
      cells/<cell name>/      the cell's run folder (its fit's TensorBoard logs, config.yaml, checkpoints/)
        cell.json             its settings, the command that trains it alone, and its attempts
        cell.log              its processes' output, appended per attempt
        metrics.json          written by the fit at its end (finished, interrupted or failed)
      report/                 tables and figures (``grids.report``)

A cell is *finished* when its ``metrics.json`` says so; *interrupted* when it says so, or when the cell has a
complete checkpoint and its last process ended by a signal or was lost (it resumes from the newest one); *failed*
when it says so or its process exited otherwise without it; *running* while a process of this machine trains it;
else *not started*. The folder holds one grid: a rerun with another grid is refused before anything is written.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ..checkpoint import is_complete_checkpoint
from ..errors import ConfigError
from ..sharding import is_sharded_checkpoint
from .spec import Cell, GridSpec, cell_command

SCHEMA = 1
GRID_FILE, GRID_JSON, GRID_LOG, CELLS = "grid.yaml", "grid.json", "grid.log", "cells"
CELL_JSON, CELL_LOG, METRICS = "cell.json", "cell.log", "metrics.json"
#: Where grids go without ``--out``: ``runs/grids/<name>``.
GRIDS_DIR = Path("runs") / "grids"
#: A cell's states.
FINISHED, INTERRUPTED, FAILED, RUNNING, NOT_STARTED = "finished", "interrupted", "failed", "running", "not started"
#: Exit statuses of a process stopped from outside: Ctrl-C (the project's 130, or Python's death by SIGINT before the
#: fit handled it), a kill (a second Ctrl-C, the out-of-memory killer).
INTERRUPTED_EXITS = (128 + signal.SIGINT, -signal.SIGINT, -signal.SIGKILL, -signal.SIGTERM)


@dataclass(frozen=True)
class CellState:
    """A cell's state, the checkpoint an interrupted one resumes from, and why (a line for the terminal)."""

    state: str
    checkpoint: Path | None = None
    detail: str = ""


def default_dir(spec: GridSpec) -> Path:
    return GRIDS_DIR / spec.name


def cell_dir(folder: Path, cell: Cell) -> Path:
    return Path(folder) / CELLS / cell.name


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as JSON atomically (a temporary file renamed over ``path``)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def read_json(path: Path) -> dict | None:
    """The JSON mapping ``path`` holds; None when it is missing or not JSON (a write cut short by a kill)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def grid_record(spec: GridSpec, cells: list[Cell]) -> dict[str, Any]:
    """What ``grid.json`` holds: the grid resolved (values as the cells' settings give them)."""
    return {
        "schema": SCHEMA,
        "name": spec.name,
        "base": str(spec.base),
        "args": spec.args,
        "axes": [
            {"name": axis.name, "key": axis.key, "labels": list(axis.labels), "values": list(axis.values)}
            for axis in spec.axes
        ],
        "zip": spec.zip,
        "report": spec.report,
        "launcher": spec.launcher,
        "cells": [
            {"name": cell.name, "labels": cell.labels, "settings": cell.settings, "dir": f"{CELLS}/{cell.name}"}
            for cell in cells
        ],
    }


def check_folder(folder: Path, spec: GridSpec, cells: list[Cell]) -> bool:
    """Whether ``folder`` already holds this grid (False: it is new or empty); a folder that holds another grid,
    or files but no grid, is refused."""
    folder = Path(folder)
    record = json.loads(json.dumps(grid_record(spec, cells), default=str))
    saved = read_json(folder / GRID_JSON)
    if saved is not None and saved != record:
        raise ConfigError(
            f"{folder} holds another grid ({difference(saved, record)}): nothing was changed; give this grid "
            f"another folder (--out DIR), or delete {folder}"
        )
    given = spec.path.resolve()
    if saved is None and folder.is_dir() and any(path.resolve() != given for path in folder.iterdir()):
        raise ConfigError(f"{folder} is not empty and holds no {GRID_JSON}: give the grid a new folder (--out DIR)")
    return saved is not None


def prepare(folder: Path, spec: GridSpec, cells: list[Cell]) -> None:
    """Make the grid's folder, or check that it holds this grid (:func:`check_folder`): ``grid.yaml`` copied once,
    ``grid.json``, and one ``cell.json`` per cell (its attempts kept)."""
    folder = Path(folder)
    if not check_folder(folder, spec, cells):
        folder.mkdir(parents=True, exist_ok=True)
        if spec.path.resolve() != (folder / GRID_FILE).resolve():
            shutil.copyfile(spec.path, folder / GRID_FILE)
        write_json(folder / GRID_JSON, grid_record(spec, cells))
    for cell in cells:
        directory = cell_dir(folder, cell)
        directory.mkdir(parents=True, exist_ok=True)
        data = read_json(directory / CELL_JSON) or {"attempts": 0, "runs": []}
        data.update(
            name=cell.name,
            labels=cell.labels,
            settings=cell.settings,
            command=cell_command(spec, cell, directory),
            log=CELL_LOG,
        )
        write_json(directory / CELL_JSON, data)


def difference(saved: dict, record: dict) -> str:
    """What first differs between two grid records, in a few words."""
    old_axes = {axis["name"]: axis for axis in saved.get("axes", [])}
    for axis in record["axes"]:
        old = old_axes.get(axis["name"])
        if old is None:
            return f"no axis {axis['name']}"
        if old != axis:
            what = "labels" if old["labels"] != axis["labels"] else "key or values"
            return f"its axis {axis['name']} has other {what}: {', '.join(old['labels'])}"
    for key in ("name", "base", "args", "axes", "zip", "report", "launcher"):
        if saved.get(key) != record.get(key):
            return f"its {key} setting differs" if key != "axes" else "its axes differ"
    return "another schema"


# ---- a cell's state ------------------------------------------------------------------------------------------


def checkpoints(directory: Path) -> list[Path]:
    """The complete checkpoints of a cell's run folder: files and sharded folders of ``checkpoints/``, and SLURM's
    requeue checkpoints (``hpc_ckpt_<n>.ckpt``) in the folder itself; temporary files of a write in progress are
    not checkpoints, and a file that fails its check is passed over."""
    directory = Path(directory)
    found = [*directory.glob("checkpoints/*.ckpt"), *directory.glob("hpc_ckpt_*.ckpt")]
    return [
        path
        for path in found
        if not path.name.startswith(".")
        and (is_sharded_checkpoint(path) if path.is_dir() else is_complete_checkpoint(path))
    ]


def newest_checkpoint(directory: Path) -> Path | None:
    """The complete checkpoint written last (its modification time), or None."""
    return max(checkpoints(directory), key=lambda path: path.stat().st_mtime_ns, default=None)


def cell_state(directory: Path) -> CellState:
    """The state of the cell whose run folder is ``directory``, from its ``metrics.json``, checkpoints and
    ``cell.json`` (module docstring)."""
    directory = Path(directory)
    runs = (read_json(directory / CELL_JSON) or {}).get("runs") or []
    last = runs[-1] if runs else None
    if last is not None and "exit" not in last and alive(last):
        return CellState(RUNNING, detail=f"process {last['pid']} on {last['host']} is training it")
    metrics = read_json(directory / METRICS)
    status = (metrics or {}).get("status")
    if status == "finished":
        return CellState(FINISHED, detail=f"finished at step {metrics.get('steps')}")
    if status == "failed":
        return CellState(FAILED, detail=f"failed: {metrics.get('error')}")
    exit_code = last.get("exit") if last else None
    if status is None and exit_code is not None and exit_code not in INTERRUPTED_EXITS:
        why = "ended without writing metrics.json" if exit_code == 0 else f"exited with status {exit_code}"
        return CellState(FAILED, detail=why)
    checkpoint = newest_checkpoint(directory)
    if checkpoint is not None:
        how = "was interrupted" if status == "interrupted" or exit_code is not None else "was lost"
        return CellState(INTERRUPTED, checkpoint, f"{how}; resumes from {checkpoint.relative_to(directory)}")
    if runs:
        return CellState(NOT_STARTED, detail="stopped before its first checkpoint: starts again")
    return CellState(NOT_STARTED)


def alive(run: dict) -> bool:
    """Whether the process of an attempt record still runs on this machine (a training process of this project)."""
    if run.get("host") != socket.gethostname() or not run.get("pid"):
        return False
    try:
        os.kill(run["pid"], 0)
        cmdline = Path(f"/proc/{run['pid']}/cmdline").read_bytes()
    except (OSError, PermissionError):
        return False
    return b"polyattn_lightning" in cmdline


# ---- attempts ------------------------------------------------------------------------------------------------


def now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def start_attempt(directory: Path, argv: list[str], resumed_from: Path | None, pid: int) -> int:
    """Record in ``cell.json`` that attempt n (returned) started: its command, checkpoint, process and time."""
    path = Path(directory) / CELL_JSON
    data = read_json(path) or {"runs": []}
    runs = data.setdefault("runs", [])
    runs.append(
        {
            "attempt": len(runs) + 1,
            "started": now(),
            "command": argv,
            "resumed_from": str(resumed_from) if resumed_from else None,
            "host": socket.gethostname(),
            "pid": pid,
        }
    )
    data["attempts"] = len(runs)
    write_json(path, data)
    return len(runs)


def end_attempt(directory: Path, exit_code: int) -> None:
    """Record the exit status of the cell's last attempt."""
    path = Path(directory) / CELL_JSON
    data = read_json(path) or {"runs": [{}]}
    data["runs"][-1].update(ended=now(), exit=exit_code)
    write_json(path, data)


def set_aside(directory: Path) -> Path | None:
    """Move what a failed attempt wrote in the cell's folder (all but ``cell.json``, ``cell.log`` and earlier
    failed attempts) into ``failed-<n>/``, so that the new attempt starts clean and nothing is lost."""
    directory = Path(directory)
    kept = {CELL_JSON, CELL_LOG}
    moved = [p for p in directory.iterdir() if p.name not in kept and not p.name.startswith("failed-")]
    if not moved:
        return None
    number = 1 + sum(1 for p in directory.iterdir() if p.name.startswith("failed-"))
    aside = directory / f"failed-{number}"
    aside.mkdir()
    for path in moved:
        path.rename(aside / path.name)
    return aside


@dataclass(frozen=True)
class Job:
    """One attempt a launcher runs: the cell, its run folder, the command, and the checkpoint it resumes from."""

    cell: Cell
    directory: Path
    argv: list[str]
    resumed_from: Path | None = None


def job(spec: GridSpec, folder: Path, cell: Cell, state: CellState) -> Job | None:
    """What a run of the grid does with a cell in ``state``: nothing when it is finished or running; resume an
    interrupted one from its checkpoint (``--ckpt_path``: the run goes on in its folder); else start it."""
    if state.state in (FINISHED, RUNNING):
        return None
    directory = cell_dir(folder, cell)
    argv = cell_command(spec, cell, directory)
    if state.state == INTERRUPTED:
        checkpoint = state.checkpoint.absolute()
        return Job(cell, directory, [*argv, f"--ckpt_path={checkpoint}"], checkpoint)
    return Job(cell, directory, argv)


class GridLog:
    """Lines for the terminal and ``grid.log`` (with the time); safe to call from several threads."""

    def __init__(self, folder: Path, stream: TextIO | None = None) -> None:
        self.path = Path(folder) / GRID_LOG
        self.stream = stream
        self.lock = threading.RLock()

    def say(self, line: str) -> None:
        with self.lock:
            print(line, file=self.stream or sys.stdout, flush=True)
            with self.path.open("a") as file:
                file.write(f"{now()} {line}\n")
