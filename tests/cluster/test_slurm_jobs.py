"""The SLURM script on a real SLURM (the private one of ``slurm_cluster.py``): a 2-task DDP job, and a preemption.

Both jobs are ``scripts/slurm/train.sbatch`` submitted as docs/howto/slurm.md tells users, from a folder that holds
the checkout's ``scripts`` and ``configs``, with the GPU node's lines overridden for this CPU node on sbatch's
command line; the config is the digits quickstart, 3 epochs of 6 steps:

* the reference job runs its 2 tasks (DDP on gloo) to exit 0, its output in ``%x-%j.out`` and its run in
  ``runs/classification/quickstart/slurm-<job id>``;
* the preempted job is sent SIGUSR1 by SLURM (``scancel --signal=USR1``, what ``--signal`` sends before a time
  limit) while both tasks hold at step :data:`HOLD_AT` (``slurm_probe.JobProbe``); the preemption callback writes
  ``runs/slurm-<job id>/hpc_ckpt_1.ckpt`` and calls SLURM's own ``scontrol requeue``; SLURM holds the requeued job
  (``BeginTime``), starts it again with ``SLURM_RESTART_COUNT=1``, the script resumes it from that checkpoint,
  and it ends bit for bit as the reference: weights, optimizer state, lr schedule, both ranks' RNG states, and the
  batches each rank trained on, none skipped or repeated.

The two jobs share the node: the reference runs while SLURM holds the requeued one, so the pair takes about as long
as the preempted job alone.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from slurm_cluster import REQUEUE_HOLD_S, SlurmCluster
from test_resume import assert_identical
from test_torchrun_jobs import final_state

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parent
EPOCHS, STEPS_PER_EPOCH = 3, 6
HOLD_AT = 8  # epoch 1, away from its validation
TIMEOUT = 900  # seconds, for each wait on a job: a minute or two of work on the quiet 2-core machine
RUN = Path("runs", "classification", "quickstart")  # the quickstart's runs (task family, config name)
# the GPU node's lines of the script, overridden on sbatch's command line for one CPU node
CPU_NODE = ["--nodes", "1", "--ntasks-per-node", "2", "--gpus-per-node", "0", "--cpus-per-task", "1"]
FIT = [
    "--trainer.accelerator",
    "cpu",
    "--trainer.deterministic",
    "true",
    "--trainer.enable_progress_bar",
    "false",
    "--trainer.max_epochs",
    str(EPOCHS),
    "--trainer.limit_train_batches",
    str(STEPS_PER_EPOCH),
    "--trainer.limit_val_batches",
    "2",
]


@dataclass
class Job:
    id: str
    checkout: Path
    probe: Path
    record: dict[str, str]

    @property
    def output(self) -> str:
        return (self.checkout / f"polyattn-{self.id}.out").read_text()

    @property
    def run(self) -> Path:
        return self.checkout / RUN / f"slurm-{self.id}"

    def probe_lines(self, kind: str, rank: int) -> list[str]:
        return (self.probe / f"{kind}-rank{rank}.txt").read_text().splitlines()


def submit(slurm: SlurmCluster, checkout: Path, probe: Path, hold_at: int | None = None) -> str:
    env = slurm.environ()
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(TESTS)])  # the probe callback
    env["OMP_NUM_THREADS"] = "1"  # one thread per task on the 2-core node
    callback = {"class_path": "slurm_probe.JobProbe", "init_args": {"folder": str(probe), "hold_at": hold_at}}
    return slurm.sbatch(
        *CPU_NODE,
        "scripts/slurm/train.sbatch",
        "configs/classification/quickstart.yaml",
        *FIT,
        f"--trainer.callbacks+={json.dumps(callback)}",
        cwd=checkout,
        env=env,
    )


@pytest.fixture(scope="module")
def jobs(slurm_cluster, tmp_path_factory) -> dict[str, Job]:
    """The preempted job and the reference, submitted together; both ended."""
    slurm = slurm_cluster
    checkout = tmp_path_factory.mktemp("checkout")  # where a user submits from
    for part in ("scripts", "configs"):
        (checkout / part).symlink_to(ROOT / part)
    probes = {name: checkout / f"probe-{name}" for name in ("preempted", "reference")}
    ids = {"preempted": submit(slurm, checkout, probes["preempted"], HOLD_AT)}
    ids["reference"] = submit(slurm, checkout, probes["reference"])  # starts when the node is free

    preempted = ids["preempted"]

    def output(job_id: str) -> str:
        path = checkout / f"polyattn-{job_id}.out"
        return path.read_text()[-3000:] if path.exists() else "(no output)"

    def held() -> bool:
        state = slurm.job(preempted)["JobState"]
        if state not in ("PENDING", "RUNNING"):
            raise AssertionError(f"job {preempted} {state} before reaching step {HOLD_AT}:\n{output(preempted)}")
        return all((probes["preempted"] / f"held-rank{rank}").exists() for rank in (0, 1))

    def status() -> str:
        return f"job {preempted} {slurm.job(preempted)['JobState']}"

    try:
        slurm.wait_until(f"both tasks of job {preempted} to reach step {HOLD_AT}", held, TIMEOUT, status)
        slurm.run("scancel", "--signal=USR1", preempted)  # to every task, as --signal=SIGUSR1@90 does
        slurm.wait_until(
            f"job {preempted} to be requeued", lambda: slurm.job(preempted)["Restarts"] == "1", 300, status
        )
        slurm.say(
            f"job {preempted} requeued: SLURM holds it {REQUEUE_HOLD_S} s (BeginTime) while the reference job "
            f"{ids['reference']} runs, then it resumes"
        )
        records = {name: slurm.wait_for_job(job_id, TIMEOUT) for name, job_id in ids.items()}
    except TimeoutError as error:
        raise AssertionError(f"{error}\n" + "\n".join(f"job {i}:\n{output(i)}" for i in ids.values())) from None
    return {name: Job(job_id, checkout, probes[name], records[name]) for name, job_id in ids.items()}


def test_the_sbatch_script_runs_two_ddp_tasks_to_exit_0_on_a_cpu_node(jobs):
    job = jobs["reference"]
    assert (job.record["JobState"], job.record["ExitCode"]) == ("COMPLETED", "0:0"), job.output[-3000:]
    assert (job.record["NumTasks"], job.record["Restarts"]) == ("2", "0")
    # its output where --output=%x-%j.out puts it: 2 processes under DDP on gloo, and the run's folder
    assert "distributed_backend=gloo" in job.output and "Starting with 2 processes" in job.output
    assert f"fit: writing logs, config and checkpoints/ to {RUN / f'slurm-{job.id}'}" in job.output
    assert (job.run / "config.yaml").is_file()
    last = torch.load(job.run / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == EPOCHS * STEPS_PER_EPOCH and len(last["rng_states"]) == 2  # one per rank
    for rank in (0, 1):  # each task trained every step once, on its own share of the data
        assert [line.split()[0] for line in job.probe_lines("batches", rank)] == [
            str(step) for step in range(EPOCHS * STEPS_PER_EPOCH)
        ]
    assert job.probe_lines("batches", 0) != job.probe_lines("batches", 1)


def test_a_job_preempted_by_slurm_is_requeued_and_ends_bit_for_bit_as_the_uninterrupted_one(jobs):
    job, reference = jobs["preempted"], jobs["reference"]
    assert (job.record["JobState"], job.record["ExitCode"]) == ("COMPLETED", "0:0"), job.output[-3000:]
    assert job.record["Restarts"] == "1"
    # the first run saved where the docs say and requeued the job itself with scontrol
    assert f"requeued SLURM job {job.id}" in job.output
    hpc = job.checkout / "runs" / f"slurm-{job.id}" / "hpc_ckpt_1.ckpt"
    stopped_at = torch.load(hpc, weights_only=True)["global_step"]
    assert HOLD_AT <= stopped_at <= HOLD_AT + 1  # the signal came during step HOLD_AT's end-of-step hooks
    # the requeued job (SLURM_RESTART_COUNT=1) started from that checkpoint on both ranks, in the same run folder
    for rank in (0, 1):
        assert job.probe_lines("starts", rank) == ["0 0", f"1 {stopped_at}"]
    assert job.output.count(f"fit: writing logs, config and checkpoints/ to {RUN / f'slurm-{job.id}'}") == 2

    # every rank trained the reference's batches, in order, each once
    for rank in (0, 1):
        assert job.probe_lines("batches", rank) == reference.probe_lines("batches", rank)
    ended, expected = (final_state(j.run / "checkpoints" / "last.ckpt") for j in (job, reference))
    assert ended["global_step"] == EPOCHS * STEPS_PER_EPOCH
    assert_identical(ended, expected, "last.ckpt")
