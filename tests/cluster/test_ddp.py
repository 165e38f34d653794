"""Real 2-process DDP on CPU (gloo), launched the documented way (torchrun), against one process.

Proves: the same global batch gives the same training on 2 ranks as on 1; a
validation set of odd size is counted once, whole, across ranks (no sampler
padding, metrics reduced); the NaN guard's skip is taken on all ranks when
only one rank's loss is NaN; and a DDP checkpoint holds every rank's RNG state.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cluster_harness import digits, tiny_classifier

import ddp_worker

pytestmark = pytest.mark.slow
TESTS = str(Path(__file__).resolve().parents[1])  # training_helpers, for the torchrun workers


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("ddp")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = subprocess.run(
        [*command, ddp_worker.__file__, str(out)], cwd=out, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))},
    )
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return torch.load(out / "result.pt", weights_only=True), out


def test_two_ranks_train_like_one_process_with_the_same_global_batch(ddp_run, tmp_path):
    ddp, _ = ddp_run
    single = ddp_worker.run(1, tmp_path)
    assert ddp["weights"].keys() == single["weights"].keys()
    for name, weight in single["weights"].items():
        assert torch.isfinite(weight).all(), f"{name}: the NaN step was not skipped"
        torch.testing.assert_close(ddp["weights"][name], weight, rtol=1e-4, atol=1e-5, msg=name)


def test_validation_counts_the_whole_set_once_across_ranks(ddp_run):
    ddp, _ = ddp_run
    assert ddp["val_set_size"] == 181
    assert ddp["val_samples_per_rank"] == [91, 90]  # no sample repeated to even out the ranks

    model = tiny_classifier().eval()
    model.load_state_dict(ddp["weights"])
    data = digits(batch_size=1, val_fraction=ddp_worker.VAL_FRACTION)
    data.setup("validate")
    images, targets = data.val_set.tensors
    with torch.no_grad():
        correct = (model(images).argmax(dim=-1) == targets).sum().item()
    assert ddp["val"]["val/top1"] == pytest.approx(correct / 181, abs=1e-6)


def test_ddp_checkpoint_holds_every_ranks_rng_state(ddp_run):
    _, out = ddp_run
    checkpoint = torch.load(out / "last.ckpt", weights_only=True)
    assert len(checkpoint["rng_states"]) == 2
