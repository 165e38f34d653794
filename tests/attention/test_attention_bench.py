"""The benchmark command on a tiny shape: it runs, writes JSON, and its memory accounting is sound."""
from __future__ import annotations

import json

import pytest
import torch

from polyattn_lightning.bench import attention as bench
from polyattn_lightning.bench.__main__ import main


def test_bench_runs_and_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["attention", "--shapes", "1x2x40x8", "--repeats", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    cases = report["results"]["1x2x40x8"]["cases"]
    assert set(cases) == {case.label for case in bench.CASES if case.device in (None, "cpu")}
    assert "poly3/fused_cpu" in cases and "poly3/triton" not in cases
    assert cases[bench.BASELINE]["ratio"]["fwd_bwd_s"] == 1.0
    assert all(entry["peak_bytes"] > 0 for entry in cases.values())
    assert "| poly3/blocked |" in capsys.readouterr().out


def test_peak_memory_sees_the_naive_score_matrices():
    inputs = bench._inputs((1, 1, 2048, 16))
    cases = {case.label: case for case in bench.CASES}
    naive = bench.peak_bytes(cases["poly3/naive"], inputs)
    assert naive >= 3 * 2048 * 2048 * 4  # S, S**3 and the saved S**2 at least
    for kernel in ("blocked", "fused_cpu"):  # the C++ kernel's per-thread tiles are allocated as tensors: counted
        tiled = bench.peak_bytes(cases[f"poly3/{kernel}"], inputs)
        assert 2048 * 16 * 4 < tiled < naive / 4


def test_cuda_without_a_gpu_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        main(["attention", "--device", "cuda", "--shapes", "1x1x8x4"])
    assert exit_info.value.code == 2
    assert "--device cuda: PyTorch sees no CUDA device" in capsys.readouterr().err
