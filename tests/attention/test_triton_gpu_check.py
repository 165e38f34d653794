"""``scripts/gpu_check.py`` without a GPU: it starts, says clearly that there is none, and exits with its own status."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_dry_run_without_a_gpu_says_so_and_exits_2(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), str(tmp_path / "out")],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "NO GPU" in result.stdout and "nothing was checked" in result.stdout
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert report["environment"]["cuda_available"] is False
    assert {part["status"] for part in report["parts"].values()} == {"skipped"}
    assert set(report["parts"]) == {"tests", "bench", "vit"}
    assert "NO GPU" in (tmp_path / "out" / "summary.txt").read_text()


def test_bad_usage_exits_3(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), str(tmp_path), "--parts", "vit,nope"],
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 3 and "nope" in result.stderr
