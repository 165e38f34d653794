"""The HF causal-LM quickstart on 2 DDP ranks (gloo, CPU) under torchrun, through the CLI: the same weights as one
process with the same global batch (Llama has no dropout, so the ranks' RNG streams do not matter)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]
CONFIG = ROOT / "configs" / "hf" / "tiny_llama_poly3.yaml"
DDP = ROOT / "configs" / "strategy" / "ddp.yaml"
GLOBAL_BATCH, STEPS = 16, 4
FIT = ["--trainer.accelerator", "cpu", "--trainer.deterministic", "true", "--trainer.enable_progress_bar", "false",
       "--trainer.max_epochs", "1", "--trainer.limit_train_batches", str(STEPS), "--trainer.limit_val_batches", "1",
       "--trainer.limit_test_batches", "1", "--data.train_size", "400", "--data.val_size", "40",
       "--data.test_size", "40"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fit(cwd: Path, devices: int) -> dict[str, torch.Tensor]:
    """The run's last.ckpt weights; the generated text and tokenizer in a folder of the test's own."""
    launcher = (["-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2", "--master_addr",
                 "127.0.0.1", "--master_port", str(free_port())] if devices > 1 else [])
    args = [*FIT, "--data.root", str(cwd.parent / "stories"), "--data.batch_size", str(GLOBAL_BATCH // devices)]
    if devices > 1:
        args += ["--trainer.devices", str(devices), "--trainer.strategy", str(DDP)]
    command = [sys.executable, *launcher, "-m", "polyattn_lightning", "fit", "--config", str(CONFIG), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    [last] = sorted(cwd.rglob("last.ckpt"))
    checkpoint = torch.load(last, weights_only=True)
    assert checkpoint["global_step"] == STEPS
    return checkpoint["state_dict"]


def test_two_ranks_train_the_tiny_llama_like_one_process(tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    single = fit(tmp_path / "one", 1)
    ddp = fit(tmp_path / "two", 2)
    assert ddp.keys() == single.keys()
    for name, weight in single.items():
        torch.testing.assert_close(ddp[name], weight, rtol=1e-4, atol=1e-5, msg=name)
