"""The attention callbacks under real 2-process DDP (gloo): no rank waits on another, rank zero writes once."""
from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

import ddp_diagnostics_worker

pytestmark = pytest.mark.slow


def test_callbacks_under_ddp_write_once_and_do_not_hang(tmp_path: Path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = subprocess.run([*command, ddp_diagnostics_worker.__file__, str(tmp_path)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    run = tmp_path / "run" / "version_0"
    assert sorted(p.name for p in tmp_path.rglob("*.png")) == [
        "step0000002_heatmaps.png", "step0000002_overlay.png", "step0000004_heatmaps.png", "step0000004_overlay.png"
    ]
    assert all(p.parent == run / "attention_maps" for p in tmp_path.rglob("*.png"))
    with open(run / "metrics.csv", newline="") as file:
        steps = [int(r["step"]) for r in csv.DictReader(file) if r.get("attention/output_norm/layer02/mean")]
    assert steps == [0, 1, 2, 3]
