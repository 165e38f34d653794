"""The HF benchmark command runs end to end on tiny sizes and reports both cases of each part against its base."""
from __future__ import annotations

import json

import pytest

from polyattn_lightning.bench.__main__ import main as bench_main


def test_hf_bench_reports_ratios(tmp_path):
    out = tmp_path / "hf.json"
    assert bench_main(["hf", "--repeats", "1", "--batch", "2", "--length", "16", "--new-tokens", "4",
                       "--cache", "5", "--calls", "3", "--instances", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["minilm_step"]) == {"softmax", "poly3"} and report["minilm_step"]["softmax"]["ratio_time"] == 1
    assert set(report["llama_generate"]) == {"sdpa", "poly3"} and report["llama_generate"]["poly3"]["ratio_time"] > 0
    copies = report["llama_generate_copies"]
    assert set(copies) == {"sdpa#0", "poly3#0", "sdpa#1", "poly3#1"}  # pooled: each case's two copies' samples
    assert sorted(report["llama_generate"]["poly3"]["samples_s"]) == sorted(
        copies["poly3#0"]["samples_s"] + copies["poly3#1"]["samples_s"])
    assert set(report["decode_call"]) == {"sdpa", "poly3", "poly3 PyTorch step"}
    assert report["decode_call"]["poly3"]["us_per_call"] > 0
    assert "load_average_before" in report["machine"]


def test_hf_bench_runs_only_the_parts_asked_and_refuses_unknown_ones(tmp_path, capsys):
    out = tmp_path / "hf.json"
    assert bench_main(["hf", "--parts", "calls", "--repeats", "1", "--calls", "2", "--json", str(out)]) == 0
    assert set(json.loads(out.read_text())) == {"command", "decode_call", "machine"}
    with pytest.raises(SystemExit):
        bench_main(["hf", "--parts", "generation"])
    assert "--parts: unknown ['generation']" in capsys.readouterr().err
