"""SLURM preemption as a job sees it: a real signal wherever it lands, a requeue, and an exact restart.

The job's environment is SLURM's (``SLURM_NTASKS``, ``SLURM_PROCID``, ``SLURM_NODELIST``, ``SLURM_JOB_ID``...),
so Lightning runs in its ``SLURMEnvironment`` with auto-requeue; a stand-in ``scontrol`` on PATH records
the requeue. The requeue signal (SIGUSR1) or SIGTERM is sent by the process to itself mid-step (after
backward, before the optimizer step: where Lightning's in-handler save lost a batch), during validation,
while a checkpoint is written, and at an epoch boundary. The restarted job calls ``fit(ckpt_path=None)``
and finds the hpc checkpoint by itself, as Lightning does under SLURM. Each is compared with an
uninterrupted run bit for bit: weights, optimizer, lr schedule, every rank's RNG states at the end, the
batches of every step (none skipped or trained twice), the loss curve and the validation passes.
One process in this process; 2 tasks as two processes (DDP on gloo), one per task, without torchrun.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_resume import assert_identical

import preemption_worker
from preemption_worker import SIGNAL_STEP, STEPS_PER_EPOCH

TESTS = str(Path(__file__).resolve().parents[1])
SCONTROL = '#!/bin/sh\necho "$@" >> "$SCONTROL_LOG"\n'  # SLURM's would requeue the job and then end it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slurm_env(folder: Path, ntasks: int, procid: int, port: int) -> dict[str, str]:
    """The variables srun gives each task of a one-node job, and a PATH with the stand-in scontrol."""
    bin_dir = folder / "bin"
    if not (bin_dir / "scontrol").exists():
        bin_dir.mkdir(parents=True, exist_ok=True)
        (bin_dir / "scontrol").write_text(SCONTROL)
        (bin_dir / "scontrol").chmod(0o755)
    return {
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "polyattn", "SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "1",
        "SLURM_NODELIST": "127.0.0.1", "SLURM_NTASKS": str(ntasks), "SLURM_NTASKS_PER_NODE": str(ntasks),
        "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(procid), "SLURM_NODEID": "0", "MASTER_PORT": str(port),
        "SCONTROL_LOG": str(folder / "scontrol.log"), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
    }


def requeues(folder: Path) -> list[str]:
    log = folder / "scontrol.log"
    return log.read_text().splitlines() if log.exists() else []


def hpc_files(root: Path) -> list[str]:
    return sorted(path.name for path in root.glob("hpc_ckpt_*.ckpt"))


def assert_continues_exactly(resumed: dict, reference: dict, resumed_from: int, validated: bool = False) -> None:
    """``validated``: the checkpoint was taken after the validation at ``resumed_from`` (last.ckpt), not before."""
    assert resumed["start_step"] == resumed_from
    assert resumed["batches"] == reference["batches"][resumed_from:]  # no batch skipped, none trained twice
    assert resumed["loss"] == {step: v for step, v in reference["loss"].items() if step >= resumed_from}
    first_pass = resumed_from + 1 if validated else resumed_from
    assert resumed["validation"] == [(step, v) for step, v in reference["validation"] if step >= first_pass]
    for key in ("weights", "optimizer", "lr_schedule", "rng"):
        assert_identical(resumed[key], reference[key], key)


# ---- one task -------------------------------------------------------------------------------------------------
@pytest.fixture
def one_task(monkeypatch, tmp_path):
    for name in [name for name in os.environ if name.startswith("SLURM_")] + ["WORLD_SIZE", "RANK", "LOCAL_RANK"]:
        monkeypatch.delenv(name, raising=False)
    for name, value in slurm_env(tmp_path, 1, 0, free_port()).items():
        monkeypatch.setenv(name, value)
    return tmp_path


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The uninterrupted one-task job."""
    folder = tmp_path_factory.mktemp("reference")
    with pytest.MonkeyPatch.context() as mp:
        for name, value in slurm_env(folder, 1, 0, free_port()).items():
            mp.setenv(name, value)
        result = preemption_worker.train(folder)
    assert requeues(folder) == [] and hpc_files(folder) == []
    return result


# (where, signal, the step the restart resumes from): the step during which the signal came, completed
CASES = {
    "mid_step": ("mid_step", signal.SIGUSR1, SIGNAL_STEP + 1),
    "validation": ("validation", signal.SIGUSR1, STEPS_PER_EPOCH),  # the pass at the end of epoch 0 runs again
    "checkpoint_write": ("checkpoint_write", signal.SIGUSR1, STEPS_PER_EPOCH + 1),
    "epoch_boundary": ("epoch_boundary", signal.SIGUSR1, STEPS_PER_EPOCH + 1),
    "sigterm_mid_step": ("mid_step", signal.SIGTERM, SIGNAL_STEP + 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_preempted_job_continues_exactly_after_requeue(one_task, reference, case):
    where, signum, resumed_from = CASES[case]
    root = one_task / "run"
    assert preemption_worker.train(root, where, signum) is None  # the job stopped itself
    assert hpc_files(root) == ["hpc_ckpt_1.ckpt"]
    assert torch.load(root / "hpc_ckpt_1.ckpt", weights_only=True)["global_step"] == resumed_from
    # SIGUSR1 requeues the job; after SIGTERM SLURM decides (it requeues a preempted --requeue job itself)
    assert requeues(one_task) == (["requeue 4242"] if signum == signal.SIGUSR1 else [])

    resumed = preemption_worker.train(root)  # the requeued job: same command, fit(ckpt_path=None)
    assert_continues_exactly(resumed, reference, resumed_from)


def test_second_preemption_keeps_only_the_newest_hpc_checkpoint(one_task, reference):
    root = one_task / "run"
    assert preemption_worker.train(root, "mid_step") is None
    assert preemption_worker.train(root, "epoch_2_boundary") is None  # the requeued job, preempted again
    assert hpc_files(root) == ["hpc_ckpt_2.ckpt"]
    assert requeues(one_task) == ["requeue 4242"] * 2
    assert_continues_exactly(preemption_worker.train(root), reference, 2 * STEPS_PER_EPOCH + 1)


def test_sigterm_too_late_for_a_checkpoint_exits_and_resumes_from_the_last_complete_one(one_task, reference):
    root = one_task / "run"
    # a KillWait the step boundary cannot meet: SLURM's SIGKILL would cut the write, so none is started
    with pytest.warns(UserWarning, match="too late to write a checkpoint"):
        assert preemption_worker.train(root, "mid_step", signal.SIGTERM, kill_wait=1e-6) is None
    assert hpc_files(root) == []
    last = root / "checkpoints" / "last.ckpt"  # written at the end of epoch 0's validation
    assert torch.load(last, weights_only=True)["global_step"] == STEPS_PER_EPOCH
    assert_continues_exactly(preemption_worker.train(root, ckpt_path=str(last)), reference, STEPS_PER_EPOCH,
                             validated=True)


def test_kill_wait_must_be_positive():
    from polyattn_lightning.callbacks import StopOnSignal
    from polyattn_lightning.errors import ConfigError

    with pytest.raises(ConfigError, match="kill_wait"):
        StopOnSignal(kill_wait=0)


# ---- two tasks ------------------------------------------------------------------------------------------------
def run_two_tasks(folder: Path, root: Path, out: Path, where: str = "none", signame: str = "SIGUSR1",
                  ranks: str = "0,1") -> None:
    """Both tasks of a 2-task job, one process each with its SLURM_PROCID, as srun starts them."""
    port = free_port()
    pythonpath = os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))
    procs = [
        subprocess.Popen(
            [sys.executable, preemption_worker.__file__, str(root), str(out), where, signame, ranks],
            env={**os.environ, **slurm_env(folder, 2, rank, port), "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in (0, 1)
    ]
    try:
        logs = [proc.communicate(timeout=600)[0] for proc in procs]  # seconds of work on free cores
    finally:
        for proc in procs:
            proc.kill()
    codes = [proc.returncode for proc in procs]
    assert codes == [0, 0], f"exit codes {codes}:\n" + "\n".join(log[-3000:] for log in logs)


@pytest.fixture(scope="module")
def two_task_reference(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("ddp_reference")
    run_two_tasks(folder, folder / "run", folder / "result.pt")
    return torch.load(folder / "result.pt", weights_only=True)


TWO_TASK_CASES = {
    # only rank 1 got the signal: the ranks still agree on the step
    "mid_step_rank_1": ("mid_step", "SIGUSR1", "1", SIGNAL_STEP + 1),
    "validation_rank_0": ("validation", "SIGUSR1", "0", STEPS_PER_EPOCH),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(TWO_TASK_CASES))
def test_two_task_job_preempted_continues_exactly(tmp_path, two_task_reference, case):
    where, signame, ranks, resumed_from = TWO_TASK_CASES[case]
    root = tmp_path / "run"
    run_two_tasks(tmp_path, root, tmp_path / "stopped.pt", where, signame, ranks)
    assert torch.load(tmp_path / "stopped.pt", weights_only=True) is None
    assert hpc_files(root) == ["hpc_ckpt_1.ckpt"]
    checkpoint = torch.load(root / "hpc_ckpt_1.ckpt", weights_only=True)
    assert checkpoint["global_step"] == resumed_from and len(checkpoint["rng_states"]) == 2
    assert requeues(tmp_path) == (["requeue 4242"] if signame == "SIGUSR1" else [])  # rank 0 only, once

    run_two_tasks(tmp_path, root, tmp_path / "resumed.pt")
    assert_continues_exactly(torch.load(tmp_path / "resumed.pt", weights_only=True), two_task_reference, resumed_from)
