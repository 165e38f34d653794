"""The local launcher: the grid's jobs on this machine, ``parallel`` processes at a time.

A thread pool of the standard library (``concurrent.futures``) bounds how many cells run; each job is one
``python -m polyattn_lightning fit`` process in a session of its own, with its output appended to its ``cell.log``
and its threads set so that ``parallel`` of them share the cores (``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``: torch's
intra-op threads). The terminal and ``grid.log`` get a line per cell started, finished, failed (with the last lines
of its log) or interrupted, and every 30 s a line naming the running cells, how long each has run and its last
output line.

Ctrl-C: no new cell starts, and each running cell gets one SIGINT, on which the project's ``StopOnSignal`` saves a
checkpoint at the next step boundary and exits with status 130; the launcher waits for them. A second Ctrl-C kills
them (their newest complete checkpoint stays). A cell counts as finished only by its own ``metrics.json``.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from ..data.base import available_cpus
from .folder import CELL_LOG, FAILED, FINISHED, CellState, GridLog, Job, cell_state, end_attempt, now, start_attempt

#: Seconds between two heartbeat lines while cells run.
HEARTBEAT_S = 30.0
#: Lines of a failed cell's log shown on the terminal.
TAIL_LINES = 12


@dataclass
class Launched:
    """What a launcher did: each launched cell's state after its attempt (a cell not launched is absent), and
    whether the user stopped the grid (Ctrl-C)."""

    states: dict[str, CellState] = field(default_factory=dict)
    stopped: bool = False


def thread_env(parallel: int) -> dict[str, str]:
    """The environment of a cell's process: this one's, with ``cores // parallel`` threads (at least one; the cores
    this process may run on)."""
    threads = str(max(1, available_cpus(cap=None) // max(1, parallel)))
    return {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "PYTHONUNBUFFERED": "1"}


def last_lines(path: Path, count: int, tail_bytes: int = 65536) -> list[str]:
    """The last ``count`` non-empty lines of a log (a progress bar's ``\\r`` updates: the last of each line)."""
    try:
        with path.open("rb") as file:
            file.seek(max(0, path.stat().st_size - tail_bytes))
            text = file.read().decode(errors="replace")
    except OSError:
        return []
    lines = [line.rsplit("\r", 1)[-1].rstrip() for line in text.split("\n")]
    return [line for line in lines if line.strip()][-count:]


def shorten(line: str, width: int) -> str:
    return line if len(line) <= width else line[: width - 3] + "..."


def duration(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"


class LocalLauncher:
    """Runs jobs as processes on this machine, ``parallel`` at a time; see the module docstring."""

    def __init__(self, log: GridLog, parallel: int = 1) -> None:
        self.log = log
        self.parallel = max(1, parallel)
        self.env = thread_env(self.parallel)
        self.lock = threading.RLock()
        self.running: dict[str, tuple[subprocess.Popen, float, Path]] = {}
        self.sigints = 0
        self.stopping = False
        self.acted = 0  # Ctrl-Cs acted on

    def run(self, jobs: list[Job]) -> Launched:
        launched = Launched()
        if not jobs:
            return launched
        threads = self.env["OMP_NUM_THREADS"]
        self.log.say(f"running {len(jobs)} cells, {self.parallel} at a time, {threads} threads each")
        main = threading.current_thread() is threading.main_thread()  # only it can take a signal
        previous = signal.signal(signal.SIGINT, self._note_sigint) if main else None
        try:
            with ThreadPoolExecutor(max_workers=self.parallel, thread_name_prefix="grid-cell") as pool:
                futures = [pool.submit(self._attempt, job) for job in jobs]
                beat = time.monotonic()
                while True:
                    finished, pending = wait(futures, timeout=0.2)
                    self._act_on_sigints()
                    if not pending:
                        break
                    if time.monotonic() - beat >= HEARTBEAT_S:
                        beat = time.monotonic()
                        self._heartbeat(len(jobs), len(finished))
            for future in futures:
                name, state = future.result()
                if state is not None:
                    launched.states[name] = state
        finally:
            if main:
                signal.signal(signal.SIGINT, previous)
        launched.stopped = self.sigints > 0
        return launched

    # -- one attempt, in a pool thread -------------------------------------------------------------------------
    def _attempt(self, job: Job) -> tuple[str, CellState | None]:
        name = job.cell.name
        log_path = job.directory / CELL_LOG
        with self.lock:
            if self.stopping:
                return name, None
            how = f"resuming from {job.resumed_from}" if job.resumed_from else "starting"
            with log_path.open("ab") as log:
                log.write(f"\n==== {now()} grid: {how}: {shlex.join(job.argv)}\n".encode())
                log.flush()
                process = subprocess.Popen(
                    job.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    start_new_session=True,  # the terminal's Ctrl-C reaches the grid only; it forwards one SIGINT
                )
            self.running[name] = (process, time.monotonic(), log_path)
        attempt = start_attempt(job.directory, job.argv, job.resumed_from, process.pid)
        self.log.say(f"started {name} (attempt {attempt}, {how.replace('resuming', 'resumed')}; log {log_path})")
        exit_code = process.wait()
        end_attempt(job.directory, exit_code)
        with self.lock:
            started = self.running.pop(name)[1]
        state = cell_state(job.directory)
        took = duration(time.monotonic() - started)
        if state.state == FINISHED:
            self.log.say(f"finished {name} in {took}")
        elif state.state == FAILED:
            tail = "\n".join(f"    {line}" for line in last_lines(log_path, TAIL_LINES))
            self.log.say(f"FAILED {name} after {took}: {state.detail}; its log ends:\n{tail}")
        else:
            self.log.say(f"interrupted {name} after {took}: {state.detail or state.state}")
        return name, state

    # -- the main thread: Ctrl-C and heartbeats ----------------------------------------------------------------
    def _note_sigint(self, signum, frame) -> None:
        """The signal handler: only notes (the main loop acts within a fraction of a second)."""
        self.sigints += 1
        self.stopping = True

    def _act_on_sigints(self) -> None:
        if self.sigints == self.acted:
            return
        first, self.acted = self.acted == 0, self.sigints
        with self.lock:
            running = dict(self.running)
        if first and self.sigints == 1:
            self.log.say(
                f"Ctrl-C: no new cells; the {len(running)} running cells save a checkpoint at their next step and "
                "stop (Ctrl-C again: kill them now)"
            )
            for process, _, _ in running.values():
                process.send_signal(signal.SIGINT)
            return
        self.log.say(f"Ctrl-C again: killing {len(running)} running cells (their newest complete checkpoints stay)")
        for process, _, _ in running.values():
            try:
                os.killpg(process.pid, signal.SIGKILL)  # its session: the loader workers too
            except ProcessLookupError:
                pass

    def _heartbeat(self, total: int, done: int) -> None:
        with self.lock:
            running = dict(self.running)
        parts = []
        for name, (_, started, log_path) in running.items():
            last = last_lines(log_path, 1)
            parts.append(
                f"{name} {duration(time.monotonic() - started)}" + (f" [{shorten(last[0], 100)}]" if last else "")
            )
        waiting = total - done - len(running)
        self.log.say(f"{done} of {total} cells ended, {waiting} waiting; running: " + "; ".join(parts))


def launch(jobs: list[Job], log: GridLog, settings: dict) -> Launched:
    """The launcher's entry point (``commands/grid.py``): ``settings["parallel"]`` processes at a time."""
    return LocalLauncher(log, int(settings.get("parallel", 1))).run(jobs)
