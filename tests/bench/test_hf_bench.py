"""The HF benchmark command runs end to end on tiny sizes and reports both cases of each part against its base."""
from __future__ import annotations

import json
import re

import pytest

from polyattn_lightning.bench.__main__ import main as bench_main
from polyattn_lightning.bench.hf import generation_text, paired, pooled, summarise


def test_hf_bench_reports_ratios(tmp_path):
    out = tmp_path / "hf.json"
    assert bench_main(["hf", "--repeats", "1", "--batch", "2", "--length", "16", "--new-tokens", "4",
                       "--cache", "5", "--calls", "3", "--instances", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["minilm_step"]) == {"softmax", "poly3"} and report["minilm_step"]["softmax"]["ratio_time"] == 1
    assert set(report["llama_generate"]) == {"sdpa", "poly3"} and report["llama_generate"]["poly3"]["ratio_time"] > 0
    copies = report["llama_generate_copies"]
    assert set(copies) == {"sdpa#0", "poly3#0", "sdpa#1", "poly3#1"}  # pooled: each case's two objects' samples
    assert sorted(report["llama_generate"]["poly3"]["samples_s"]) == sorted(
        copies["poly3#0"]["samples_s"] + copies["poly3#1"]["samples_s"])
    samples = {name: entry["samples_s"] for name, entry in copies.items()}
    ratios = sorted(a / b for i in "01" for a, b in zip(samples[f"poly3#{i}"], samples[f"sdpa#{i}"]))
    pairs = report["llama_generate_paired"]
    assert pairs["pairs"] == 2 and pairs["median"] == pytest.approx(sum(ratios) / 2)
    assert pairs["ci95"] == [ratios[0], ratios[1]]  # two pairs: the interval is their range
    assert set(report["decode_call"]) == {"sdpa", "poly3", "poly3 PyTorch step"}
    assert report["decode_call"]["poly3"]["us_per_call"] > 0
    assert "load_average_before" in report["machine"]


def test_paired_ratios_pair_each_object_s_rounds_and_bound_the_median():
    # base times differ by object and by round, so pairing across objects or rounds gives other ratios:
    # object 0's ratios 1.1, 1.2, ..., 6.0, object 1's all 2.0
    truth = {0: [1 + r / 10 for r in range(1, 51)], 1: [2.0] * 50}
    times = {f"sdpa#{i}": [(i + 1) * (1 + r / 100) for r in range(50)] for i in truth}
    times.update({f"poly3#{i}": [t * q for t, q in zip(times[f"sdpa#{i}"], truth[i])] for i in truth})
    result = paired(times, "poly3", "sdpa")
    ratios = sorted(truth[0] + truth[1])
    assert result["pairs"] == 100 and result["median"] == pytest.approx((ratios[49] + ratios[50]) / 2)
    assert result["ci95"] == pytest.approx([ratios[39], ratios[60]])  # n = 100: the textbook order statistics 40 and 61
    with pytest.raises(ValueError):  # a case without its base's samples of every round
        paired({"sdpa#0": [1.0], "poly3#0": [1.0, 2.0]}, "poly3", "sdpa")


def test_hf_bench_runs_only_the_parts_asked_and_refuses_unknown_ones(tmp_path, capsys):
    out = tmp_path / "hf.json"
    assert bench_main(["hf", "--parts", "calls", "--repeats", "1", "--calls", "2", "--json", str(out)]) == 0
    assert set(json.loads(out.read_text())) == {"command", "decode_call", "machine"}
    with pytest.raises(SystemExit):
        bench_main(["hf", "--parts", "generation"])
    assert "--parts: unknown ['generation']" in capsys.readouterr().err


def test_the_generation_table_and_headline_give_one_ratio_the_paired_median_with_its_interval():
    # three objects whose placement makes them fast or slow: paired ratios 1.2, 0.95 and 1.1 each round, while the
    # pooled medians (2.0 and 1.9 s) give 0.95, a ratio no object measured
    base, ratio = {0: 1.0, 1: 2.0, 2: 3.0}, {0: 1.2, 1: 0.95, 2: 1.1}
    times = {f"sdpa#{i}": [base[i] * (1 + r / 1000) for r in range(4)] for i in base}
    times.update({f"poly3#{i}": [t * ratio[i] for t in times[f"sdpa#{i}"]] for i in base})
    report = {"llama_generate": summarise(pooled(times), "sdpa", 128, "tokens"),
              "llama_generate_copies": summarise(times, "sdpa#0", 128, "tokens"),
              "llama_generate_paired": paired(times, "poly3", "sdpa")}
    assert report["llama_generate"]["poly3"]["ratio_time"] == pytest.approx(0.95, abs=0.01)  # the pooled one
    text = generation_text(report, 128)
    header, _, sdpa_row, poly3_row = text.splitlines()[1:5]
    assert header.split("|")[4].strip() == "x sdpa (paired median)"
    assert sdpa_row.split("|")[4].strip() == "1.000" and poly3_row.split("|")[4].strip() == "1.100"
    [headline] = [line for line in text.splitlines() if line.startswith("poly3 / sdpa")]
    assert re.match(r"poly3 / sdpa: 1\.100x, 95% interval 0\.950-1\.200 \(the median of 12 paired ratios", headline)
    assert "0.95x" not in text and "0.950 |" not in text  # the pooled medians' ratio is not shown as a ratio
