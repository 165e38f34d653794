"""What runs inside a SLURM array task of a grid (:mod:`.slurm` submits them): :class:`SlurmCell` trains one cell
with the project's CLI in the task's own process, its output appended to the cell's ``cell.log`` and its attempt
recorded in ``cell.json``; the fit's Lightning ``SLURMEnvironment`` gets submitit's preemption signal as its requeue
signal, so one signal serves both (the module docstring of :mod:`.slurm` says why)."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .folder import (
    CELL_JSON,
    CELL_LOG,
    FINISHED,
    INTERRUPTED,
    RUNNING,
    Job,
    cell_state,
    end_attempt,
    now,
    read_json,
    start_attempt,
    write_json,
)

try:  # the [cluster] extra; without it, the launcher says how to install it (slurm.require_submitit)
    from submitit.helpers import Checkpointable
    from submitit.slurm.slurm import SlurmJobEnvironment
except ModuleNotFoundError:
    Checkpointable = object

#: The interpreter prefix of a cell's command (``python -m polyattn_lightning``), run in-process here.
PACKAGE = "polyattn_lightning"


def requeue_signal() -> str:
    """The one preemption signal, by name (``SIGUSR2``): submitit's, which its sbatch script asks for."""
    return f"SIG{SlurmJobEnvironment.USR_SIG}"


def fit_args(argv: list[str]) -> list[str]:
    """A cell's command without its interpreter (``python -m polyattn_lightning``): the CLI's arguments."""
    if argv[1:3] != ["-m", PACKAGE]:
        raise ValueError(f"not a command of this project's CLI: {shlex.join(argv[:3])}")
    return argv[3:]


def slurm_plugin_arg() -> str:
    """The fit's Lightning SLURM environment, with submitit's signal as its requeue signal."""
    plugin = {
        "class_path": "lightning.fabric.plugins.environments.SLURMEnvironment",
        "init_args": {"requeue_signal": requeue_signal()},
    }
    return f"--trainer.plugins+={json.dumps(plugin)}"


@contextlib.contextmanager
def output_to(path: Path) -> Iterator[None]:
    """This process's stdout and stderr (file descriptors 1 and 2) appended to ``path`` for the block."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with path.open("ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)


def exit_status(code: Any) -> int:
    """A ``SystemExit`` code as the status the process would exit with."""
    return code if isinstance(code, int) else (0 if code is None else 1)


class SlurmCell(Checkpointable):
    """An array task's call: train one cell in this process (module docstring). ``Checkpointable``: on a signal
    outside the fit submitit requeues the task with the same call, which reads the cell's state again."""

    def __init__(self, job: Job) -> None:
        self.name = job.cell.name
        self.directory = Path(job.directory).absolute()
        self.args = [arg for arg in fit_args(job.argv) if not arg.startswith("--ckpt_path=")]

    def __call__(self) -> dict[str, str]:
        state = cell_state(self.directory)
        if state.state in (FINISHED, RUNNING):
            return {"cell": self.name, "state": state.state, "detail": f"not trained again: {state.detail}"}
        resumed_from = state.checkpoint.absolute() if state.state == INTERRUPTED else None
        args = [*self.args, slurm_plugin_arg(), *([f"--ckpt_path={resumed_from}"] if resumed_from else [])]
        threads = os.environ.get("SLURM_CPUS_PER_TASK")
        if threads:
            os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = threads
        job_id = slurm_job_id()
        how = f"resuming from {resumed_from}" if resumed_from else "starting"
        log_path = self.directory / CELL_LOG
        with log_path.open("a") as log:
            log.write(f"\n==== {now()} grid: {how}: {shlex.join(['polyattn', *args])}\n")
            log.write(f"==== SLURM job {job_id} on {socket.gethostname()}, restart {restart_count()}\n")
        start_attempt(self.directory, ["polyattn", *args], resumed_from, os.getpid())
        note_slurm_job(self.directory, job_id)
        code, argv = 1, sys.argv
        try:
            with output_to(log_path):
                if threads:
                    import torch

                    torch.set_num_threads(int(threads))
                from ..cli import main

                sys.argv = ["polyattn"]  # the command line is args, not submitit's
                main(args)
            code = 0
        except SystemExit as stop:  # the CLI's exit: a user error (2), a stop by a signal (StopOnSignal)
            code = exit_status(stop.code)
            raise
        finally:
            sys.argv = argv
            end_attempt(self.directory, code)
        state = cell_state(self.directory)
        return {"cell": self.name, "state": state.state, "detail": state.detail}


def slurm_job_id() -> str:
    """This task's SLURM job id (``<array job>_<task>`` in an array)."""
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    return f"{array}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array else os.environ.get("SLURM_JOB_ID", "?")


def restart_count() -> int:
    return int(os.environ.get("SLURM_RESTART_COUNT", "0"))


def note_slurm_job(directory: Path, job_id: str) -> None:
    """Add the SLURM job id and restart count to the cell's last attempt record."""
    path = Path(directory) / CELL_JSON
    data = read_json(path) or {"runs": [{}]}
    data["runs"][-1].update(slurm_job=job_id, restart=restart_count())
    write_json(path, data)
