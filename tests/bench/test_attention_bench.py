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


def test_lra_cases_pad_keys_and_add_dropout_twins(tmp_path):
    """``--key-padding`` pads each sequence's tail (naive cases, which take no mask, are left out);
    ``--dropout`` adds a twin of each case whose kernel has dropout; poly3 is checked against softmax's twin."""
    out = tmp_path / "bench.json"
    cases = "softmax/sdpa+dropout0.1,poly3/fused_cpu+dropout0.1,poly1/associative,poly3/fused_cpu,poly3/naive"
    argv = ["attention", "--shapes", "3x1x64x4", "--repeats", "1", "--no-memory", "--key-padding", "0-0.5",
            "--dropout", "0.1", "--cases", cases, "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    result = report["results"]["3x1x64x4"]
    assert result["key_lengths"] == [64, 48, 32]
    assert set(result["cases"]) == {"softmax/sdpa", "softmax/sdpa+dropout0.1", "poly3/fused_cpu",
                                    "poly3/fused_cpu+dropout0.1", "poly1/associative"}
    targets = [check["target"] for check in report["targets"]]
    assert "poly3/fused_cpu+dropout0.1 fwd+bwd time / softmax/sdpa+dropout0.1 at 3x1x64x4 <= 1.0" in targets
    labels = {case.label for case in bench.dropout_twins(bench.CASES, 0.2)}
    assert {"softmax/sdpa+dropout0.2", "poly3/blocked+dropout0.2"} <= labels
    assert not any(label.startswith(("poly1/associative", "poly3/naive")) for label in labels)


def test_lra_targets_compare_with_softmax_and_its_dropout_twin():
    def entry(seconds):
        return {"fwd_s": seconds, "fwd_bwd_s": seconds, "ratio": {"fwd_bwd_s": seconds}}

    cases = {"softmax/sdpa": entry(1.0), "softmax/sdpa+dropout0.1": entry(3.0), "poly3/fused_cpu": entry(0.8),
             "poly3/fused_cpu+dropout0.1": entry(3.75), "poly1/associative": entry(0.25)}
    result = {"shape": {"B": 4, "H": 2, "N": 4096, "d": 32}, "key_lengths": [4096, 2048], "cases": cases}
    checks = {check["target"]: (check["value"], check["met"]) for check in bench.check_targets({"lra-4k": result})}
    assert checks["poly3/fused_cpu+dropout0.1 fwd+bwd time / softmax/sdpa+dropout0.1 at lra-4k <= 1.0"] == (1.25, False)
    assert checks["poly1/associative speed-up over softmax/sdpa (fwd+bwd) at lra-4k >= 5"] == (4.0, False)
    assert checks["poly3/fused_cpu fwd+bwd time / SDPA at lra-4k <= 1.0"] == (0.8, True)


def test_causal_twins_run_and_check_linear_memory(tmp_path):
    out = tmp_path / "causal.json"
    wanted = "poly3/fused_cpu,poly3/fused_cpu+causal,softmax/sdpa+causal,poly1/associative+causal"
    assert main(["attention", "--shapes", "1x2x64x8,1x2x256x8", "--repeats", "1", "--causal", "--cases", wanted,
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["results"]["1x2x64x8"]["cases"]) == set(wanted.split(",")) | {bench.BASELINE}
    memory = [c for c in report["targets"] if "peak bytes per query row" in c["target"]]
    assert len(memory) == 1 and memory[0]["met"]  # causal poly1's memory grows linearly, not 4x per row
