"""A private SLURM on this machine for the tests: its own munged, slurmctld and slurmd, one node, one partition.

The ``slurm`` fixture (``tests/conftest.py``, any test directory) hands a test a running :class:`SlurmCluster`
with the cluster's client settings in ``os.environ`` for that test only; ``slurm_cluster`` is the same cluster for
module-scoped fixtures, which pass ``cluster.environ()`` to the commands they run. The cluster is started once per
test session (per pytest-xdist worker), on first use, and stopped at its end; a SLURM already running on the
machine is left alone:

* munged with its own key (1024 random bytes) and socket in the cluster's folder (``AuthInfo=socket=...``);
* ``slurm.conf`` generated in that folder: free ports of its own (``SlurmctldPort``, ``SlurmdPort``), state, spool,
  pid and log files there; one node ``localhost`` with ``nproc`` CPUs and the memory of ``/proc/meminfo``; one
  partition, :data:`PARTITION`, the default; ``JobRequeue=1``; ``AuthInfo=cred_expire=30``, which is also how long
  SLURM holds a requeued job before it may start again (``BeginTime``; 120 s by default); scheduling passes every
  2 s; finished jobs stay visible to ``scontrol show job`` for an hour (``MinJobAge``); no accounting database, so
  ``sacct`` answers "accounting storage is disabled";
* at the end, the jobs still queued are cancelled and the three daemons it started are stopped by their ids.

A job runs with the environment of the command that submitted it (sbatch's ``--export=ALL``): :meth:`environ` is
``os.environ`` without any job's ``SLURM_*``/``SBATCH_*`` variables or a launcher's (``MASTER_ADDR``, ``RANK``...),
plus ``SLURM_CONF``, this interpreter's scripts folder first on ``PATH`` (so ``lightning``, ``polyattn`` and
``python`` are this environment's) and this checkout first on ``PYTHONPATH``, so the jobs run the code under test.

Without SLURM (no ``slurmctld``/``slurmd``/``munged``: Debian's ``apt-get install slurm-wlm munge``; ``.ci/run``
installs them), without root (slurmd starts each job as its user), or when a daemon does not come up, every test
that asks for the cluster skips with one line saying why; with ``POLYATTN_REQUIRE_SLURM=1`` (set by ``.ci/run``)
that line fails them instead.

A test that submits through submitit, e.g. a grid as a job array, needs nothing more than the fixture::

    def test_grid_array(slurm, tmp_path):  # SLURM_CONF, PATH, PYTHONPATH are set for this test
        executor = submitit.AutoExecutor(folder=tmp_path / "submitit")  # "slurm": sbatch and srun are on PATH
        executor.update_parameters(slurm_partition=slurm.partition, cpus_per_task=1, timeout_min=10,
                                   slurm_array_parallelism=slurm.cpus)
        jobs = executor.map_array(train_cell, cells)
        first = jobs[0].job_id  # "<array job id>_0"
        slurm.wait_until(f"array task {first} to train", lambda: ...)  # e.g. its cell's first checkpoint written
        slurm.run("scancel", first)  # cancelled midway
        assert slurm.wait_for_job(first)["JobState"] == "CANCELLED"

and a command such as ``polyattn grid --launcher slurm`` run with ``subprocess`` inherits the same variables.
Each array task takes its ``cpus_per_task`` of the node's :attr:`SlurmCluster.cpus`; the rest wait their turn.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, TypeVar

#: The only partition, the default one: submitit's ``slurm_partition``.
PARTITION = "debug"
NODE = "localhost"
#: SLURM holds a requeued job this long before it may start again (cred_expire; SLURM's default is 120 s).
REQUEUE_HOLD_S = 30
#: States in which a job has ended for good (a requeued job passes through REQUEUED and PENDING instead).
ENDED = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
)
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "scancel", "sinfo", "squeue", "munge", "unmunge")
#: A launcher's variables for torch.distributed: a job's ranks take theirs from SLURM, never from the submitter.
LAUNCHER = frozenset(
    {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE"}
)
#: Where Debian puts the daemons; a user's PATH often leaves it out.
SBIN = ("/usr/sbin", "/sbin", "/usr/local/sbin")
ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


class SlurmUnavailable(Exception):
    """SLURM cannot run here: the message is the one line the skipped tests show."""


def unavailable_reason() -> str | None:
    """Why no private SLURM can start on this machine, in one line, or None."""
    missing = [name for name in DAEMONS + CLIENTS if find(name) is None]
    if missing:
        return (
            f"no {', '.join(missing)} on this machine: install SLURM with `apt-get install slurm-wlm munge`"
            " (.ci/run does)"
        )
    if os.geteuid() != 0:
        return "not root: slurmd must start each job as its user, so the private SLURM runs only as root"
    return None


def find(program: str) -> str | None:
    return shutil.which(program, path=os.pathsep.join([os.environ.get("PATH", ""), *SBIN]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def memory_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    raise SlurmUnavailable("no MemTotal in /proc/meminfo: cannot size the node")


def parse_record(line: str) -> dict[str, str]:
    """``scontrol show -o``'s ``Key=value Key=value...`` line as a dict."""
    return dict(re.findall(r"(\S+?)=(\S*)", line))


class SlurmCluster:
    """One node, one partition, started by :meth:`start` in ``folder`` and stopped by :meth:`stop`.

    ``say`` shows a line to the person running the tests (the fixture writes it to the terminal); every line
    also goes to ``folder/cluster.log``.
    """

    def __init__(self, folder: Path, say: Callable[[str], None] = print) -> None:
        self.folder = folder
        self.conf = folder / "slurm.conf"
        self.partition = PARTITION
        self.node = NODE
        self.cpus = len(os.sched_getaffinity(0))  # nproc
        self._say = say
        self._daemons: dict[str, subprocess.Popen] = {}

    # -- what tests use ------------------------------------------------------------------------------------------
    def environ(self) -> dict[str, str]:
        """The environment for the cluster's client commands and for the jobs they submit (see the module)."""
        env = {
            name: value
            for name, value in os.environ.items()
            if not name.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SQUEUE_", "SINFO_")) and name not in LAUNCHER
        }
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", ""), *SBIN])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        return env

    def run(self, *command: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
        """A client command (``sbatch``, ``scancel``...) against this cluster; its stdout; an error says its stderr."""
        result = subprocess.run(command, cwd=cwd, env=env or self.environ(), capture_output=True, text=True, timeout=60)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}): {result.stderr.strip()}")
        return result.stdout

    def sbatch(self, *args: str, cwd: Path, env: dict[str, str] | None = None) -> str:
        """Submit, as ``sbatch ARGS`` in ``cwd``; the job's id."""
        return self.run("sbatch", "--parsable", *args, cwd=cwd, env=env).strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s record of ``job_id`` (``JobState``, ``Reason``, ``Restarts``, ``ExitCode``...)."""
        return parse_record(self.run("scontrol", "show", "job", "-o", job_id).splitlines()[0])

    def wait_until(
        self, what: str, check: Callable[[], T], timeout: float = 600, status: Callable[[], str] | None = None
    ) -> T:
        """Poll ``check`` until it returns something true, and return that; after 10 s say what is awaited (with
        ``status()``) every 30 s; a TimeoutError after ``timeout`` seconds."""
        start = time.monotonic()
        next_say = start + 10
        while not (result := check()):
            waited = time.monotonic() - start
            now_status = f" ({status()})" if status else ""
            if waited > timeout:
                raise TimeoutError(f"{what}: not within {timeout:.0f} s{now_status}")
            if time.monotonic() >= next_say:
                self.say(f"waiting for {what}: {waited:.0f} s so far{now_status}")
                next_say += 30
            time.sleep(0.5)
        return result

    def wait_for_job(self, job_id: str, timeout: float = 600) -> dict[str, str]:
        """Wait until ``job_id`` has ended for good (a requeued job runs again first); its last record."""

        def ended() -> dict[str, str] | None:
            record = self.job(job_id)
            return record if record["JobState"] in ENDED else None

        def state() -> str:
            record = self.job(job_id)
            return f"job {job_id} {record['JobState']}, reason {record['Reason']}, restarts {record['Restarts']}"

        return self.wait_until(f"job {job_id} to end", ended, timeout, state)

    def say(self, line: str) -> None:
        with open(self.folder / "cluster.log", "a") as log:
            log.write(f"{time.strftime('%H:%M:%S')} {line}\n")
        self._say(f"[slurm] {line}")

    # -- start and stop ------------------------------------------------------------------------------------------
    def start(self) -> None:
        """munged, then slurmctld and slurmd; returns once ``sinfo`` shows the node idle. SlurmUnavailable says why
        one did not come up."""
        for part in ("munge", "state", "spool", "log"):
            (self.folder / part).mkdir(parents=True, exist_ok=True)
        self._start_munge()
        self.conf.write_text(self._slurm_conf())
        (self.folder / "plugstack.conf").write_text("")  # no SPANK plugins: not the machine's
        for daemon in ("slurmctld", "slurmd"):
            self._spawn(
                daemon, [find(daemon), "-D", "-f", str(self.conf)] + (["-N", NODE] if daemon == "slurmd" else [])
            )
        try:
            self.wait_until(f"node {NODE} to be idle in sinfo", self._node_idle, timeout=120, status=self._node_state)
        except TimeoutError as error:
            raise SlurmUnavailable(f"{error}; slurmctld/slurmd logs in {self.folder / 'log'}") from None
        self.say(f"cluster up: {self.cpus} CPUs, partition {PARTITION}, SLURM_CONF={self.conf}")

    def stop(self) -> None:
        """Cancel the jobs still queued, wait for them to end, then stop the daemons this cluster started."""
        if "slurmctld" in self._daemons and self._daemons["slurmctld"].poll() is None:
            try:
                queued = self.run("squeue", "-h", "-o", "%A").split()
                if queued:
                    self.say(f"cancelling the jobs left in the queue: {' '.join(queued)}")
                    self.run("scancel", *queued)
                    self.wait_until(
                        "the cancelled jobs to leave the queue",
                        lambda: not self.run("squeue", "-h", "-o", "%A").split(),
                        timeout=90,
                    )
            except (RuntimeError, TimeoutError, subprocess.TimeoutExpired) as error:
                self.say(f"stopping the daemons with jobs not cleaned up: {error}")
        for name in ("slurmd", "slurmctld", "munged"):  # the reverse of the start
            process = self._daemons.pop(name, None)
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()

    def _spawn(self, name: str, command: list[str]) -> subprocess.Popen:
        """A daemon in the foreground, so that its id is the one this cluster stops."""
        with open(self.folder / "log" / f"{name}.out", "ab") as out:
            process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.environ(),
                start_new_session=True,
            )
        self._daemons[name] = process
        return process

    def _start_munge(self) -> None:
        munge = self.folder / "munge"
        munge.chmod(0o755)  # munged wants its socket's folder searchable by all
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        # --force: pytest's temporary folders are private (0700) to this user, and every process that talks to
        # this munged (the daemons, the client commands, the jobs) is this user's
        self._spawn(
            "munged",
            [
                find("munged"),
                "--foreground",
                "--force",
                f"--socket={munge / 'munge.socket'}",
                f"--key-file={key}",
                f"--pid-file={munge / 'munged.pid'}",
                f"--log-file={self.folder / 'log' / 'munged.log'}",
                f"--seed-file={munge / 'seed'}",
            ],
        )

        def credential_round_trip() -> bool:
            if self._daemons["munged"].poll() is not None:
                raise SlurmUnavailable(f"munged did not start: {self._last_words('munged')}")
            socket_ = f"--socket={munge / 'munge.socket'}"
            encoded = subprocess.run([find("munge"), socket_, "-n"], capture_output=True)
            if encoded.returncode != 0:
                return False
            decoded = subprocess.run([find("unmunge"), socket_], input=encoded.stdout, capture_output=True)
            return decoded.returncode == 0

        try:
            self.wait_until("munged to answer (munge -n | unmunge)", credential_round_trip, timeout=30)
        except TimeoutError as error:
            raise SlurmUnavailable(str(error)) from None

    def _slurm_conf(self) -> str:
        folder = self.folder
        return "\n".join(
            [
                "ClusterName=polyattn-tests",
                f"SlurmctldHost={NODE}(127.0.0.1)",
                f"SlurmctldPort={free_port()}",
                f"SlurmdPort={free_port()}",
                "SlurmUser=root",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={folder / 'munge' / 'munge.socket'},cred_expire={REQUEUE_HOLD_S}",
                f"StateSaveLocation={folder / 'state'}",
                f"SlurmdSpoolDir={folder / 'spool'}",
                f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
                f"SlurmdPidFile={folder / 'slurmd.pid'}",
                f"SlurmctldLogFile={folder / 'log' / 'slurmctld.log'}",
                f"SlurmdLogFile={folder / 'log' / 'slurmd.log'}",
                f"PlugStackConfig={folder / 'plugstack.conf'}",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SchedulerType=sched/backfill",
                "SchedulerParameters=sched_interval=2,bf_interval=2",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core",
                "SlurmdParameters=config_overrides",  # the node as configured, whatever cores the hardware reports
                "ReturnToService=2",
                "MpiDefault=none",
                "MailProg=/bin/true",  # no mail is sent; the default path is not installed
                "JobRequeue=1",
                "KillWait=30",
                "MinJobAge=3600",
                f"NodeName={NODE} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={memory_mb()} State=UNKNOWN",
                f"PartitionName={PARTITION} Nodes={NODE} Default=YES MaxTime=INFINITE State=UP",
                "",
            ]
        )

    def _node_state(self) -> str:
        result = subprocess.run(
            ["sinfo", "-h", "-N", "-n", NODE, "-o", "%T"],
            env=self.environ(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        return result.stdout.strip() or result.stderr.strip() or "no answer"

    def _node_idle(self) -> bool:
        for name, process in self._daemons.items():
            if process.poll() is not None:
                raise SlurmUnavailable(f"{name} exited with status {process.returncode}: {self._last_words(name)}")
        return self._node_state() == "idle"

    def _last_words(self, name: str) -> str:
        """A daemon's last error line (its output, then its log file), and where its logs are."""
        lines = []
        for path in (self.folder / "log" / f"{name}.out", self.folder / "log" / f"{name}.log"):
            if path.exists():
                lines += [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
        errors = [line for line in lines if "error" in line.lower()] or lines
        return f"{errors[-1].strip() if errors else 'no output'} (logs in {self.folder / 'log'})"
