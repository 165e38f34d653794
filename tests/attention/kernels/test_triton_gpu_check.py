"""``scripts/gpu_check.py`` without a GPU: it starts, says clearly that there is none, and exits with its own status."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[3]


def test_dry_run_without_a_gpu_says_so_and_exits_2(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), str(tmp_path / "out")],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "NO GPU" in result.stdout and "nothing was checked" in result.stdout
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert report["environment"]["cuda_available"] is False
    assert {part["status"] for part in report["parts"].values()} == {"skipped"}
    assert set(report["parts"]) == {"tests", "bench", "vit", "timing", "decoder"}
    assert "NO GPU" in (tmp_path / "out" / "summary.txt").read_text()


def test_bad_usage_exits_3(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), str(tmp_path), "--parts", "vit,nope"],
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 3 and "nope" in result.stderr
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), str(tmp_path), "--workers", "-1"],
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 3 and "--workers -1: expected 0" in result.stderr
    for limits in ("tests=soon", "tests=0", "vits=60"):
        result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), str(tmp_path), "--limits", limits],
                                env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True, timeout=300)
        assert result.returncode == 3 and "--limits" in result.stderr and limits in result.stderr, limits


def test_dry_run_times_every_case_on_cpu(tmp_path):
    """``--dry-run``: the timing part's cases on CPU at a tiny shape, written as the GPU run writes them."""
    script = ROOT / "scripts" / "gpu_check.py"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, str(script), str(tmp_path), "--dry-run"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "timing.json").read_text())
    sys.path.insert(0, str(script.parent))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(script.parent))
    assert set(report["cases"]) == set(gpu_check.TIMING_CASES) and report["device"] == "cpu"
    assert all(case["median_ms"] > 0 for case in report["cases"].values())
    assert report["cases"]["bf16"]["vs_bf16"] == 1.0
    assert report["cases"]["bf16 dropout 0.1"]["host_syncs"] == []
    assert "fp32 high (tf32x3):" in result.stdout
    decoder = json.loads((tmp_path / "decoder.json").read_text())  # the sharding issue's GPU goal, tiny on CPU
    assert decoder["device"] == "cpu" and set(decoder["median_step_ms"]) == {"softmax", "poly3"}
    assert all(len(losses) == 3 for losses in decoder["losses"].values())  # warm-up + 2 timed steps each
    assert decoder["losses"]["softmax"][0] != decoder["losses"]["poly3"][0]  # the switch took effect
    assert "poly3" in result.stdout and "x softmax (target <= 1.11" in result.stdout


def test_pins_the_machine_does_not_meet_are_named(monkeypatch):
    """A GPU machine brings its own packages: the check names those the project does not admit (an H200 image's
    timm 1.0.29 lacked a module the switch imports) and ignores torch and triton, which are the machine's."""
    script = ROOT / "scripts" / "gpu_check.py"
    sys.path.insert(0, str(script.parent))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(script.parent))
    assert gpu_check.unmet_pins() == []  # this environment was installed as the project pins
    versions = {"timm": "1.0.29", "jsonargparse": None, "torch": "2.11.0"}
    real = gpu_check._version
    monkeypatch.setattr(gpu_check, "_version", lambda name: versions[name] if name in versions else real(name))
    unmet = gpu_check.unmet_pins()
    assert len(unmet) == 2, unmet
    assert any(line.startswith("jsonargparse missing (the project admits") for line in unmet)
    assert any(line.startswith("timm 1.0.29 (the project admits ==1.0.31)") for line in unmet)
