"""The SLURM launcher: the grid's jobs as one SLURM job array submitted through submitit, each cell trained inside its
array task's own process.

``polyattn grid GRID.yaml --launcher slurm`` hands the cells that need training to submitit's ``AutoExecutor`` as one
array (``executor.batch()``); SLURM queues and runs them, ``slurm_array_parallelism`` at a time. The resources are the
grid file's ``launcher.slurm`` mapping, in submitit's names: its shared ones (``timeout_min``, ``cpus_per_task``,
``mem_gb``, ``gpus_per_node``, ``tasks_per_node``, ``nodes``, ``name``) and the SLURM executor's, with or without their
``slurm_`` prefix (``partition``, ``array_parallelism``, ``account``, ``qos``, ``constraint``,
``additional_parameters``...); ``--parallel N`` above 1 sets the array's parallelism. A key submitit does not take is
one error naming the closest. Every array task is requeueable (``--requeue``). The launch line lists every sbatch
setting, and ``--dry-run`` shows the array's sbatch script (:func:`describe`). submitit keeps its job files and each
task's own log in ``<grid>/slurm/``.

Each task calls :class:`SlurmCell`, which trains the cell with the project's CLI in the task's process
(``polyattn_lightning.cli.main(["fit", ...])``, the cell's command without its interpreter), its output appended to the
cell's ``cell.log`` and its attempt recorded in ``cell.json`` (with the SLURM job id). The task first reads the cell's
state again: a finished cell is not trained again, an interrupted one resumes from its newest complete checkpoint, so a
requeued task, restarted by SLURM with the same pickled call, goes on where it stopped.

Preemption and time limits use ONE signal: submitit's (``SUBMITIT_PREEMPT_SIGNAL``, ``USR2`` by default), which its
sbatch script asks SLURM to send ``signal_delay_s`` (90 s) before the limit, is also the requeue signal of the fit's
Lightning ``SLURMEnvironment`` (given on the fit's command line). During the fit Lightning's handlers replace
submitit's, and the project's ``StopOnSignal`` acts on the signal at the next training-step boundary: it writes
``hpc_ckpt_<n>.ckpt`` in the cell's folder, runs ``scontrol requeue`` and exits; the requeued task resumes from that
checkpoint. That is the only safe place for the save: submitit's own handler would checkpoint from inside the signal
handler, mid-step. Outside the fit (before the model is built, after it ended) submitit's handler is in place; the
callable is a ``submitit.helpers.Checkpointable`` whose default ``checkpoint()`` resubmits the same call, so submitit
requeues the task instead of failing it (a non-checkpointable callable fails with ``UncompletedJobError`` on a time
limit), and the restarted call finds the cell's state in its folder. A plain ``scancel`` (SIGTERM) makes the fit save
the same checkpoint when its next step ends within SLURM's ``KillWait`` and exit; the task ends ``CANCELLED``, the cell
is interrupted, and running the grid command again resumes it.

While the array runs, the launcher waits on submitit's job objects (``job.done()``, ``job.state``) and says every 30 s
how many tasks are queued, running and ended; when a task ends it reads the cell's state from its files
(``metrics.json``: a cancelled task's cell is not finished). Each cell's ``cell.json`` records the task submitted for
it: a rerun while that task is still queued or running waits for it instead of submitting the cell again. submitit asks
``sacct`` for the states, which needs SLURM's accounting database; a cluster without one would leave a task that ended
without a result (a cancelled one) waiting forever, so the jobs watch the queue with ``squeue`` instead
(:class:`QueueWatcher`). Ctrl-C cancels the array (running cells save their checkpoint on SLURM's SIGTERM, as above) and
waits for its tasks to end; a second Ctrl-C stops waiting.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import ConfigError, closest_option
from .folder import (
    CELL_JSON,
    CELL_LOG,
    FAILED,
    FINISHED,
    INTERRUPTED,
    RUNNING,
    CellState,
    GridLog,
    Job,
    cell_state,
    end_attempt,
    now,
    read_json,
    start_attempt,
    write_json,
)
from .local import HEARTBEAT_S, TAIL_LINES, Launched, duration, last_lines

try:  # the [cluster] extra; without it, --launcher slurm says how to install it (require_submitit)
    import submitit
    from submitit.helpers import Checkpointable
    from submitit.slurm.slurm import (
        SlurmExecutor,
        SlurmInfoWatcher,
        SlurmJob,
        SlurmJobEnvironment,
        _make_sbatch_string,
    )
except ModuleNotFoundError:
    submitit = None
    Checkpointable = SlurmInfoWatcher = object

#: The grid folder's subfolder for submitit's job files and the tasks' own logs.
SUBMITIT_DIR = "slurm"
#: Seconds between two looks at the array's tasks (a result file; the queue at most every :data:`QUEUE_POLL_S`).
POLL_S = 2.0
QUEUE_POLL_S = 10.0
#: A task's queue states, as the progress lines count them (any other state of a task not done: running).
QUEUED = ("PENDING", "REQUEUED", "CONFIGURING", "UNKNOWN", "SUSPENDED")
#: The end states of a task that failed outside its fit (its cell may have written nothing).
TASK_FAILED = ("FAILED", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL", "TIMEOUT", "DEADLINE")
#: The state :class:`QueueWatcher` gives a task squeue no longer lists: it has ended.
GONE = "ENDED"
#: The interpreter prefix of a cell's command (``python -m polyattn_lightning``), run in-process here.
PACKAGE = "polyattn_lightning"


def require_submitit() -> None:
    """A one-line error saying how to install submitit, where it is not."""
    if submitit is None:
        raise ConfigError(
            "--launcher slurm submits through submitit, which is not installed: pip install "
            "'polyattn-lightning[cluster]'"
        )


def requeue_signal() -> str:
    """The one preemption signal, by name (``SIGUSR2``): submitit's, which its sbatch script asks for."""
    return f"SIG{SlurmJobEnvironment.USR_SIG}"


# ---- the grid file's settings as submitit's ------------------------------------------------------------------


def executor_parameters(settings: dict[str, Any]) -> dict[str, Any]:
    """The grid file's ``launcher.slurm`` mapping (and ``parallel``, the ``--parallel`` flag) as keyword arguments
    of ``AutoExecutor.update_parameters``; a key submitit does not take is one :class:`ConfigError`."""
    shared = sorted(submitit.AutoExecutor._valid_parameters())
    slurm_keys = sorted(SlurmExecutor._valid_parameters())
    parameters: dict[str, Any] = {}
    for key, value in settings.items():
        if key == "parallel":
            continue
        name = key if key in shared or key.startswith("slurm_") else f"slurm_{key}"
        if name not in shared and name.removeprefix("slurm_") not in slurm_keys:
            valid = [*shared, *slurm_keys]
            closest = closest_option(key.removeprefix("slurm_"), valid)
            hint = f" (did you mean {closest}?)" if closest else ""
            raise ConfigError(
                f"launcher.slurm: unknown key {key}{hint}; submitit takes {', '.join(valid)} (SLURM's with or "
                "without the slurm_ prefix)"
            )
        parameters[name] = value
    if int(settings.get("parallel", 1)) > 1:
        parameters["slurm_array_parallelism"] = int(settings["parallel"])  # the flag wins over the file
    extra = dict(parameters.get("slurm_additional_parameters") or {})
    parameters["slurm_additional_parameters"] = {"requeue": True, **extra}
    return parameters


def make_executor(folder: Path, settings: dict[str, Any], name: str) -> Any:
    """submitit's executor for SLURM with the grid's parameters; its job files in ``folder``."""
    require_submitit()
    try:
        executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
    except RuntimeError as error:  # no srun: not a machine that submits to SLURM
        raise ConfigError(f"--launcher slurm: {error} (submit from a machine of the SLURM cluster)") from None
    parameters = {"name": name, **executor_parameters(settings)}
    try:
        executor.update_parameters(**parameters)
    except (NameError, ValueError, AssertionError, TypeError) as error:
        raise ConfigError(f"launcher.slurm: submitit refuses the settings: {str(error).splitlines()[0]}") from None
    return executor


def sbatch_script(executor: Any, tasks: int) -> str:
    """The sbatch script submitit writes for ``tasks`` tasks with ``executor``'s parameters: an array, or one job
    for one task (submitit submits a batch of one as a plain job)."""
    slurm = executor._executor
    return _make_sbatch_string(
        command=slurm._submitit_command_str,
        folder=slurm.folder,
        map_count=tasks if tasks > 1 else None,
        **slurm.parameters,
    )


def submission(tasks: int) -> str:
    """How ``tasks`` cells go to SLURM, in words."""
    return f"{tasks} cells as one SLURM job array" if tasks > 1 else "1 cell as one SLURM job"


def sbatch_flags(script: str) -> list[str]:
    """The ``#SBATCH`` lines of a script, as flags."""
    return [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]


def describe(jobs: list[Job], log_dir: Path, settings: dict[str, Any]) -> str:
    """What ``--dry-run`` shows for this launcher: the array's sbatch script (``jobs``: the cells a run would
    submit; ``log_dir``: the grid's folder)."""
    if not jobs:
        return "--launcher slurm: nothing to submit"
    executor = make_executor(Path(log_dir) / SUBMITIT_DIR, settings, job_name(log_dir))
    script = sbatch_script(executor, len(jobs))
    lines = [line for line in script.splitlines() if line.startswith(("#SBATCH", "srun"))]
    return "\n".join(
        [
            f"--launcher slurm: {submission(len(jobs))} through submitit; its sbatch script:",
            *(f"    {line}" for line in lines),
            (
                "    each task: the cell's fit in the task's process, with --trainer.plugins+=SLURMEnvironment"
                f"(requeue_signal={requeue_signal()})"
            ),
        ]
    )


def job_name(grid_dir: Path) -> str:
    return f"grid-{Path(grid_dir).resolve().name}"


# ---- the array task ------------------------------------------------------------------------------------------


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


def note_submission(directory: Path, job_id: str) -> None:
    """Record in the cell's ``cell.json`` the SLURM task submitted for it (a rerun waits for it while it lives)."""
    path = Path(directory) / CELL_JSON
    data = read_json(path) or {}
    data["slurm"] = {"job": job_id, "submitted": now()}
    write_json(path, data)


def array_id(task: Any) -> str:
    return task.job_id.split("_")[0]


def array_ids(tasks: list[Any]) -> str:
    return ", ".join(sorted({array_id(task) for task in tasks}, key=int))


def note_slurm_job(directory: Path, job_id: str) -> None:
    """Add the SLURM job id and restart count to the cell's last attempt record."""
    path = Path(directory) / CELL_JSON
    data = read_json(path) or {"runs": [{}]}
    data["runs"][-1].update(slurm_job=job_id, restart=restart_count())
    write_json(path, data)


# ---- waiting for the array -----------------------------------------------------------------------------------


class QueueWatcher(SlurmInfoWatcher):
    """submitit's watcher of SLURM jobs, asking ``squeue`` instead of ``sacct`` (module docstring): a task's state
    while SLURM lists it (queued, running, or ended within ``MinJobAge``), :data:`GONE` once it does not."""

    def _make_command(self) -> list[str] | None:
        if not self._registered - self._finished:
            return None
        return ["squeue", "--me", "--array", "--states=all", "--format=%i|%T|%N"]

    def read_info(self, string: bytes | str) -> dict[str, dict[str, str]]:
        text = string.decode() if isinstance(string, bytes) else string
        listed = {}
        for line in text.splitlines()[1:]:  # after the header
            job_id, state, nodes = (line.split("|") + ["", ""])[:3]
            listed[job_id.strip()] = {"JobID": job_id.strip(), "State": state.strip(), "NodeList": nodes.strip()}
        for job_id in self._registered - set(listed):
            listed[job_id] = {"JobID": job_id, "State": GONE, "NodeList": ""}
        return listed


class SlurmLauncher:
    """Submits the jobs as one array and waits for it; see the module docstring."""

    def __init__(self, log: GridLog, settings: dict[str, Any]) -> None:
        self.log = log
        self.grid_dir = log.path.parent
        self.executor = make_executor(self.grid_dir / SUBMITIT_DIR, settings, job_name(self.grid_dir))
        self.watcher = QueueWatcher(delay_s=QUEUE_POLL_S)
        self.sigints = 0

    def run(self, jobs: list[Job]) -> Launched:
        launched = Launched()
        if not jobs:
            return launched
        tasks = {job.cell.name: task for job in jobs if (task := self._live_task(job)) is not None}
        for name, task in tasks.items():
            self.log.say(
                f"{name}: its SLURM task {task.job_id} from an earlier run is still {task.state}: waiting for it, "
                "not submitting the cell again"
            )
        new = [job for job in jobs if job.cell.name not in tasks]
        if new:
            flags = sbatch_flags(sbatch_script(self.executor, len(new)))
            self.log.say(f"submitting {submission(len(new))} through submitit: {' '.join(flags)}")
            with self.executor.batch():  # one array; each task's callable a SlurmCell (Checkpointable)
                submitted = [self.executor.submit(SlurmCell(job)) for job in new]
            for job, task in zip(new, submitted):
                task.watcher = self.watcher  # this watcher for these jobs (submitit's class default asks sacct)
                note_submission(job.directory, task.job_id)
                tasks[job.cell.name] = task
            self.log.say(
                f"SLURM job {array_id(submitted[0])}: {len(submitted)} tasks; submitit's files and the tasks' "
                f"logs in {self.executor.folder}; each cell's output in its cell.log"
            )
        previous = signal.signal(signal.SIGINT, self._note_sigint)
        try:
            launched.states = self._wait(jobs, [tasks[job.cell.name] for job in jobs])
        finally:
            signal.signal(signal.SIGINT, previous)
        launched.stopped = self.sigints > 0
        return launched

    def _live_task(self, job: Job) -> Any | None:
        """The SLURM task an earlier run submitted for the cell, while SLURM still has it queued or running."""
        record = (read_json(job.directory / CELL_JSON) or {}).get("slurm")
        if not record:
            return None
        task = SlurmJob(folder=self.executor.folder, job_id=record["job"])
        task.watcher = self.watcher
        return None if task.done(force_check=True) else task

    def _wait(self, jobs: list[Job], tasks: list[Any]) -> dict[str, CellState]:
        """Wait for every task to end (or a second Ctrl-C); each ended task's cell state, said as it ends."""
        states: dict[str, CellState] = {}
        start = beat = time.monotonic()
        cancelled = False
        while len(states) < len(jobs):
            if self.sigints and not cancelled:
                cancelled = True
                self.log.say(
                    "Ctrl-C: cancelling the array's tasks (scancel): queued ones are dropped, running cells save a "
                    "checkpoint at their next step and stop; waiting for them (Ctrl-C again: stop waiting)"
                )
                for job, task in zip(jobs, tasks):
                    if job.cell.name not in states:
                        task.cancel(check=False)
            if self.sigints > 1:
                self.log.say(f"Ctrl-C again: not waiting for the SLURM tasks any more: {array_ids(tasks)}")
                break
            for job, task in zip(jobs, tasks):
                if job.cell.name not in states and task.done():
                    states[job.cell.name] = self._ended(job, task, time.monotonic() - start)
            if time.monotonic() - beat >= HEARTBEAT_S:
                beat = time.monotonic()
                self._heartbeat([task for job, task in zip(jobs, tasks) if job.cell.name not in states])
            time.sleep(POLL_S)
        return states

    def _ended(self, job: Job, task: Any, took_s: float) -> CellState:
        """The cell's state once its task ended, said on the terminal; a task SLURM ended as failed leaves its cell
        failed unless the cell says otherwise (it may have written nothing)."""
        state, name, took = cell_state(job.directory), job.cell.name, duration(took_s)
        if state.state not in (FINISHED, INTERRUPTED, FAILED) and task.state in TASK_FAILED:
            state = CellState(FAILED, detail=f"its SLURM task ended {task.state}")
        if state.state == FINISHED:
            self.log.say(f"finished {name} (task {task.job_id}) {took} after the submission")
        elif state.state == FAILED:
            tail = "\n".join(f"    {line}" for line in last_lines(job.directory / CELL_LOG, TAIL_LINES))
            self.log.say(
                f"FAILED {name} (task {task.job_id}, {task.state}): {state.detail}; its log ends:\n{tail}\n"
                f"    the task's own log: {task.paths.stderr}"
            )
        else:
            self.log.say(f"interrupted {name} (task {task.job_id}, {task.state}): {state.detail or state.state}")
        return state

    def _heartbeat(self, waiting: list[Any]) -> None:
        states = [task.state for task in waiting]
        queued = sum(state in QUEUED for state in states)
        running = len(states) - queued
        self.log.say(
            f"SLURM job {array_ids(waiting)}: {queued} queued, {running} running, waiting for {len(waiting)} tasks"
        )

    def _note_sigint(self, signum, frame) -> None:
        self.sigints += 1


def launch(jobs: list[Job], log: GridLog, settings: dict[str, Any]) -> Launched:
    """The launcher's entry point (``commands/grid.py``): one SLURM job array of ``jobs``."""
    return SlurmLauncher(log, settings).run(jobs)
