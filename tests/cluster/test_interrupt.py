"""Ctrl-C during fit, as a user presses it: a real SIGINT (``os.kill``) at the very first step, mid-step, during
validation and at a step after which validation is due, reaching every rank (a terminal) or one rank only.

The run writes ``last.ckpt`` at the next step boundary, says where (one line), and stops with :class:`Interrupted`
(exit status 130); resumed from that checkpoint it ends as the uninterrupted run does, bit for bit: weights,
optimizer state, lr schedule, every rank's RNG states, the batches of every step, the losses and the validation
passes. A second Ctrl-C stops at once without a checkpoint. One process in this process, without any cluster
environment; 2 ranks under torchrun, DDP and the sharded strategy (FSDP2), in one launch (``interrupt_worker.py``).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_preemption import assert_continues_exactly, free_port

import interrupt_worker
from interrupt_worker import CASES, saved_step
from preemption_worker import STEPS_PER_EPOCH

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    return interrupt_worker.train(tmp_path_factory.mktemp("reference"))


@pytest.mark.parametrize("case", list(CASES))
def test_ctrl_c_saves_at_the_step_boundary_and_the_run_resumes_exactly(tmp_path, capfd, caplog, reference, case):
    where, _, resumed_from = CASES[case]
    handler = signal.getsignal(signal.SIGINT)
    root, last = tmp_path / "run", tmp_path / "run" / "checkpoints" / "last.ckpt"
    with caplog.at_level(logging.INFO):
        assert interrupt_worker.train(root, where=where) is None  # Interrupted, exit status 130 in a process
    assert signal.getsignal(signal.SIGINT) is handler  # Python's Ctrl-C again once the run is over
    # said at once, from the signal handler (one unbuffered write)
    assert "Ctrl-C: stopping at the end of this training step, after writing a checkpoint" in capfd.readouterr().err
    [line] = [record.getMessage() for record in caplog.records if record.getMessage().startswith("Ctrl-C: saved")]
    assert line.startswith(f"Ctrl-C: saved {last} at step {resumed_from}")
    assert line.endswith(f"resume with: fit(..., ckpt_path='{last}')")
    assert saved_step(last) == resumed_from
    assert_continues_exactly(interrupt_worker.train(root, ckpt_path=str(last)), reference, resumed_from)


def test_a_second_ctrl_c_stops_at_once_without_a_checkpoint(tmp_path, capfd, caplog):
    last = tmp_path / "checkpoints" / "last.ckpt"
    with caplog.at_level(logging.INFO), pytest.raises(SystemExit) as stop:
        interrupt_worker.train(tmp_path, where="mid_step", times=2)
    # Lightning's shutdown after a KeyboardInterrupt: the CLI exits with 130 for it (tests/cli/test_ctrl_c.py)
    assert stop.value.code == 1 and isinstance(stop.value.__context__, KeyboardInterrupt)
    assert saved_step(last) == STEPS_PER_EPOCH  # the last.ckpt of epoch 0's validation, not one of the step
    assert f"Ctrl-C again: stopping now; no checkpoint written; the newest is {last}" in capfd.readouterr().err
    assert not [record for record in caplog.records if record.getMessage().startswith("Ctrl-C: saved")]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    """``interrupt_worker.py`` on 2 ranks under torchrun, every case under DDP and FSDP2; its output folder."""
    out = tmp_path_factory.mktemp("two_ranks")
    pythonpath = os.pathsep.join(filter(None, [str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH")]))
    torchrun = f"--nnodes 1 --nproc_per_node 2 --master_addr 127.0.0.1 --master_port {free_port()}".split()
    command = [sys.executable, "-m", "torch.distributed.run", *torchrun, str(HERE / "interrupt_worker.py"), str(out)]
    env = {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ddp", "fsdp"])
@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_stopped_by_ctrl_c_resume_exactly(two_ranks, layout, case):
    _, _, resumed_from = CASES[case]
    results = two_ranks / layout
    stopped = torch.load(results / f"{case}_stopped.pt", weights_only=True)
    assert stopped == {"result": None, "step": resumed_from}
    resumed, reference = (torch.load(results / f"{name}.pt", weights_only=True) for name in (case, "reference"))
    assert_continues_exactly(resumed, reference, resumed_from)


@pytest.mark.slow
def test_the_ranks_agree_during_validation_with_unequal_batch_counts(two_ranks):
    """The DDP runs validate on a split the ranks hold in 12 and 11 batches (no sample repeated): agreeing after every
    batch would leave rank 0 alone in a collective."""
    reference = torch.load(two_ranks / "ddp" / "reference.pt", weights_only=True)
    assert reference["val_batches"] == [[12], [11]]
