"""``polyattn grid GRID.yaml [--launcher local|slurm] [--parallel N] [--dry-run] [--out DIR]`` and
``polyattn grid report DIR``: every cell of a grid trained, each an ordinary ``fit`` in its own run folder, then the
report.

A run reads the grid file (:mod:`~polyattn_lightning.grids.spec`), checks every axis value against the base
config's CLI, makes or checks the grid's folder (:mod:`~polyattn_lightning.grids.folder`) and hands the cells that
need training to the launcher: finished cells are skipped, interrupted ones resumed from their newest complete
checkpoint, failed ones started again (what they wrote set aside), the rest started. Run the same command again to
complete a grid; ``--dry-run`` lists each cell's state and the exact command it would run, and changes nothing.
The summary counts cells done, failed, skipped and interrupted; the exit status is 130 after a Ctrl-C, 1 when a cell
failed, else 0.
"""

from __future__ import annotations

import importlib
import importlib.util
import shlex
import sys
from pathlib import Path

from ..errors import ArgumentParser, ConfigError, MissingPathError
from ..grids.folder import (
    FAILED,
    FINISHED,
    GRID_JSON,
    INTERRUPTED,
    NOT_STARTED,
    RUNNING,
    CellState,
    GridLog,
    cell_dir,
    cell_state,
    check_folder,
    default_dir,
    job,
    prepare,
    set_aside,
)
from ..grids.spec import cells, check_keys, read_grid

#: The launchers: ``--launcher NAME`` runs ``launch(jobs, log, settings)`` of the module (settings: the grid
#: file's ``launcher.<name>`` mapping and ``parallel``), which returns a ``grids.local.Launched`` when they end;
#: ``--dry-run`` also prints its ``describe(jobs, folder, settings)`` where it has one.
LAUNCHERS = {"local": "polyattn_lightning.grids.local", "slurm": "polyattn_lightning.grids.slurm"}
#: The module that writes a grid's tables and figures (``write_report(grid_dir)``).
REPORT_MODULE = "polyattn_lightning.grids.report"
#: Exit status after a Ctrl-C (as a shell reports a program SIGINT ended).
EXIT_INTERRUPTED = 130


def parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="polyattn grid",
        description="Train every cell of a grid (a base config and axes of CLI settings), each an ordinary fit in "
        "its own run folder; run again to resume. `polyattn grid report DIR` writes the grid's tables and figures.",
    )
    p.add_argument("grid", type=Path, help="the grid file (YAML: name, base, args, axes, zip, report, launcher)")
    p.add_argument("--launcher", choices=sorted(LAUNCHERS), default="local", help="where the cells run")
    p.add_argument("--parallel", type=int, default=1, help="cells at a time (local: processes on this machine)")
    p.add_argument("--dry-run", action="store_true", help="list the cells, their states and commands; run nothing")
    p.add_argument("--out", type=Path, help="the grid's folder (default: runs/grids/<name>)")
    return p


def report_parser() -> ArgumentParser:
    p = ArgumentParser(prog="polyattn grid report", description="Write a grid's tables and figures (DIR/report/).")
    p.add_argument("dir", type=Path, help="the grid's folder (it holds grid.json)")
    return p


def main(argv: list[str] | None = None) -> None:
    """``polyattn grid ...``: exits with status 130 after a Ctrl-C, 1 when a cell failed (module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["report"]:
        folder = report_parser().parse_args(argv[1:]).dir
        if not (folder / GRID_JSON).is_file():
            raise MissingPathError(f"{folder}: no {GRID_JSON}: expected the folder of a grid `polyattn grid` ran")
        return write_report(folder, GridLog(folder))
    status = run(parser().parse_args(argv))
    if status:
        raise SystemExit(status)


def run(args) -> int:
    """Run the grid the parsed command line names; the exit status."""
    if args.parallel < 1:
        raise ConfigError(f"--parallel {args.parallel}: expected a number of cells at a time, at least 1")
    spec = read_grid(args.grid)
    grid_cells = cells(spec)
    folder = args.out or default_dir(spec)
    check_keys(spec)
    launcher = LAUNCHERS[args.launcher]
    settings = {**spec.launcher.get(args.launcher, {}), "parallel": args.parallel}
    if args.dry_run:
        return dry_run(spec, grid_cells, folder, importlib.import_module(launcher), settings)
    prepare(folder, spec, grid_cells)
    log = GridLog(folder)
    log.say(f"grid {spec.name}: {len(grid_cells)} cells in {folder} ({spec.path})")
    jobs, skipped = plan(spec, grid_cells, folder, log)
    launched = importlib.import_module(launcher).launch(jobs, log, settings)
    states = [state.state for state in launched.states.values()]
    counts = {
        "done": states.count(FINISHED),
        "failed": states.count(FAILED),
        "skipped": skipped,
        "interrupted": states.count(INTERRUPTED) + states.count(NOT_STARTED),
        "not started": len(jobs) - len(states),
    }
    log.say(
        f"grid {spec.name}: "
        + ", ".join(
            f"{count} {what}" for what, count in counts.items() if count or what in ("done", "failed", "skipped")
        )
    )
    launcher_args = ["--launcher", args.launcher] if args.launcher != "local" else []
    rerun = shlex.join(
        ["polyattn", "grid", str(args.grid), "--out", str(folder), *launcher_args, "--parallel", str(args.parallel)]
    )
    if launched.stopped:
        log.say(f"stopped by Ctrl-C; to go on, run again: {rerun}")
        return EXIT_INTERRUPTED
    write_report(folder, log)
    if counts["failed"]:
        log.say(
            f"{counts['failed']} cells failed (their logs: {folder}/cells/<cell>/cell.log); run again to retry: {rerun}"
        )
        return 1
    return 0


def plan(spec, grid_cells, folder: Path, log: GridLog) -> tuple[list, int]:
    """The jobs of this run (each cell by its state: skipped, resumed, started again or started) and the number of
    cells skipped; a failed cell's files are set aside first."""
    jobs, skipped = [], 0
    for cell in grid_cells:
        state = cell_state(cell_dir(folder, cell))
        if state.state in (FINISHED, RUNNING):
            skipped += 1
            log.say(f"skipped {cell.name}: {state.detail}")
            continue
        if state.state == FAILED and (aside := set_aside(cell_dir(folder, cell))) is not None:
            log.say(f"{cell.name} {state.detail}: what it wrote is kept in {aside}; it starts again")
        jobs.append(job(spec, folder, cell, state))
    return jobs, skipped


def dry_run(spec, grid_cells, folder: Path, launcher, settings: dict) -> int:
    """List every cell with its state in ``folder`` and the command a run would give it, then what the launcher
    would do with them where it says (its ``describe(jobs, folder, settings)``: SLURM's sbatch script); write
    nothing."""
    exists = check_folder(folder, spec, grid_cells)
    print(f"grid {spec.name}: {len(grid_cells)} cells in {folder}" + ("" if exists else " (a new folder)"))
    jobs = []
    for cell in grid_cells:
        state = cell_state(cell_dir(folder, cell)) if exists else CellState(NOT_STARTED)
        planned = job(spec, folder, cell, state)
        action = {FINISHED: "skip", RUNNING: "skip", INTERRUPTED: "resume", FAILED: "start again"}.get(
            state.state, "start"
        )
        print(f"{cell.name}: {state.state}{f' ({state.detail})' if state.detail else ''} -> {action}")
        if planned is not None:
            print(f"    {shlex.join(planned.argv)}")
            jobs.append(planned)
    if hasattr(launcher, "describe"):
        print(launcher.describe(jobs, folder, settings))
    return 0


def write_report(folder: Path, log: GridLog) -> None:
    """The grid's report (``grids.report.write_report``), or one line saying this version has none."""
    if importlib.util.find_spec(REPORT_MODULE) is None:
        log.say(
            f"report: not available in this version ({REPORT_MODULE} is not installed); the cells' results are "
            f"in {folder}/cells/<cell>/metrics.json"
        )
        return
    importlib.import_module(REPORT_MODULE).write_report(folder)
