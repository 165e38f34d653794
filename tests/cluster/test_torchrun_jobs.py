"""2-rank jobs through the CLI and the quickstart configs under torchrun: a rank killed, and two nodes.

* A rank SIGKILLed mid-epoch (what the out-of-memory killer does) ends the whole job promptly: torchrun
  sees the dead worker and stops the other; resumed from its ``last.ckpt`` the job ends with the
  uninterrupted run's weights, optimizer, lr schedule and RNG states, bit for bit.
* Two nodes without a container engine: two ``torchrun --nnodes 2`` processes (node ranks 0 and 1, c10d
  rendezvous on the loopback address), stopped part-way the same way and resumed on both nodes.

Both have world size 2 and the same global batch, so one uninterrupted 2-rank run is the reference for both.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_resume import assert_identical

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]
QUICKSTART = ROOT / "configs" / "classification" / "quickstart.yaml"
DDP = ROOT / "configs" / "strategy" / "ddp.yaml"
TESTS = Path(__file__).parent
STEPS_PER_EPOCH, KILL_STEP = 6, 8  # the kill comes in epoch 1; last.ckpt holds step 6 (epoch 0's validation)
FIT = ["--trainer.accelerator", "cpu", "--trainer.deterministic", "true", "--trainer.enable_progress_bar", "false",
       "--trainer.max_epochs", "2", "--trainer.limit_train_batches", str(STEPS_PER_EPOCH),
       "--trainer.limit_val_batches", "2", "--trainer.strategy", str(DDP)]
TIMEOUT = 600  # per job; each is seconds of work on free cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict[str, str]:
    pythonpath = os.pathsep.join(filter(None, [str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}


def torchrun(node_args: list[str], devices: int, nodes: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *node_args, "-m", "polyattn_lightning", "fit",
            "--config", str(QUICKSTART), *FIT, "--trainer.devices", str(devices), "--trainer.num_nodes", str(nodes),
            *extra]


def kill_rank(rank: int, marker: Path) -> list[str]:
    spec = {"class_path": "rank_kill.SigkillRank", "init_args": {"rank": rank, "step": KILL_STEP, "marker": str(marker)}}
    return [f"--trainer.callbacks+={json.dumps(spec)}"]


def one_node(cwd: Path, extra: list[str] = ()) -> list[subprocess.Popen]:
    command = torchrun(["--nnodes", "1", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                        "--master_port", str(free_port())], 2, 1, list(extra))
    return [subprocess.Popen(command, cwd=cwd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]


def two_nodes(cwd: Path, extra_per_node: tuple[list[str], list[str]] = ([], [])) -> list[subprocess.Popen]:
    port = free_port()
    return [
        subprocess.Popen(
            torchrun(["--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(node), "--rdzv_backend", "c10d",
                      "--rdzv_id", "two-nodes", "--rdzv_endpoint", f"127.0.0.1:{port}"], 1, 2, extra_per_node[node]),
            cwd=cwd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for node in (0, 1)
    ]


def finish(procs: list[subprocess.Popen]) -> tuple[list[int], str]:
    try:
        logs = [proc.communicate(timeout=TIMEOUT)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    return [proc.returncode for proc in procs], "\n".join(log[-3000:] for log in logs)


def last_checkpoints(cwd: Path) -> list[Path]:
    return sorted(cwd.rglob("last.ckpt"))


def final_state(path: Path) -> dict:
    checkpoint = torch.load(path, weights_only=True)
    return {key: checkpoint[key] for key in ("global_step", "state_dict", "optimizer_states", "lr_schedulers",
                                             "rng_states")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    cwd = tmp_path_factory.mktemp("reference")
    codes, logs = finish(one_node(cwd))
    assert codes == [0], logs
    [last] = last_checkpoints(cwd)
    state = final_state(last)
    assert state["global_step"] == 2 * STEPS_PER_EPOCH and len(state["rng_states"]) == 2
    return state


def stop_and_resume(tmp_path: Path, start) -> Path:
    """Run ``start(cwd, marker)`` (a job whose rank 1 dies at KILL_STEP), check that it ended soon; its last.ckpt."""
    marker = tmp_path / "killed_at"
    codes, logs = finish(start(tmp_path, marker))
    ended = time.time()
    assert all(code != 0 for code in codes), f"the job did not fail: {codes}\n{logs}"
    assert marker.exists(), logs
    # bounded end: the dead rank's peers did not wait out a collective timeout (the strategy's is 5 min)
    assert ended - float(marker.read_text()) < 60, logs
    [last] = last_checkpoints(tmp_path)
    assert torch.load(last, weights_only=True)["global_step"] == STEPS_PER_EPOCH
    return last


def test_a_killed_rank_ends_the_job_and_it_resumes_exactly(tmp_path, reference):
    last = stop_and_resume(tmp_path, lambda cwd, marker: one_node(cwd, kill_rank(1, marker)))
    codes, logs = finish(one_node(tmp_path, ["--ckpt_path", str(last)]))
    assert codes == [0], logs
    assert last_checkpoints(tmp_path) == [last]  # the resumed run goes on in its own folder
    assert_identical(final_state(last), reference, "resumed")


def test_two_nodes_stopped_and_resumed_match_an_uninterrupted_run(tmp_path, reference):
    # the c10d rendezvous may give either node global rank 1: both carry the callback, which acts on rank 1
    last = stop_and_resume(tmp_path, lambda cwd, marker: two_nodes(cwd, (kill_rank(1, marker), kill_rank(1, marker))))
    codes, logs = finish(two_nodes(tmp_path, (["--ckpt_path", str(last)], ["--ckpt_path", str(last)])))
    assert codes == [0, 0], logs
    assert last_checkpoints(tmp_path) == [last]
    assert_identical(final_state(last), reference, "resumed")
