"""The linear-form benchmark commands (crossover, long-context, decode) run end to end at tiny sizes, and the
crossover table they write is the one ``kernel="auto"`` and ``RecurrentCache`` read."""

from __future__ import annotations

import json
import math

import pytest
import torch

from polyattn_lightning.attention.kernels import base
from polyattn_lightning.bench.__main__ import main as bench_main
from polyattn_lightning.bench.timing import crossing, write_table_rows


def test_crossing_interpolates_where_the_ratio_stays_below_one():
    # log-log: ratio 2 at 100, 0.5 at 200 -> 1 at sqrt(100 * 200)
    assert crossing([100, 200, 400], [2.0, 0.5, 0.25]) == pytest.approx(math.sqrt(100 * 200))
    # below 1, above, below again: from the last crossing (1.1 at 200, 0.5 at 400)
    expected = 200 * math.exp(math.log(1.1) * math.log(2) / math.log(1.1 / 0.5))
    assert crossing([100, 200, 400], [0.9, 1.1, 0.5]) == pytest.approx(expected)
    assert crossing([100, 200], [0.5, 0.4]) == 100  # faster from the shortest length
    assert crossing([100, 200], [1.5, 1.2]) is None
    assert crossing([100, 200, 400], [0.5, 1.2, 2.0]) is None  # slower again at the end


def test_table_rows_merge_per_key(tmp_path):
    path = tmp_path / "table.json"
    write_table_rows(path, "cpu/x/2 threads", [dict(p=3, d=8, causal=False, mode="train", n=100)], quadratic_seconds=1.0)
    write_table_rows(path, "cpu/x/2 threads", [dict(p=3, d=8, causal=False, mode="train", n=120),
                                               dict(p=3, d=8, causal=True, mode="decode", n=50)], command="c")
    entry = json.loads(path.read_text())["devices"]["cpu/x/2 threads"]
    assert entry["measured"] and entry["quadratic_seconds"] == 1.0 and len(entry["measured_by"]) == 2
    assert sorted((r["mode"], r["n"]) for r in entry["crossover"]) == [("decode", 50), ("train", 120)]


def test_crossover_writes_the_table_auto_reads(tmp_path, monkeypatch):
    table, report = tmp_path / "crossover.json", tmp_path / "report.json"
    argv = ["crossover", "--powers", "2", "--dims", "4", "--lengths", "16,32", "--repeats", "1", "--causal", "no",
            "--modes", "train", "--write", str(table), "--json", str(report)]
    assert bench_main(argv) == 0
    entry = json.loads(table.read_text())["devices"][base.device_key(torch.device("cpu"))]
    (row,) = entry["crossover"]
    assert (row["p"], row["d"], row["causal"], row["mode"]) == (2, 4, False, "train")
    assert entry["quadratic_seconds"] > 0
    points = json.loads(report.read_text())["rows"][0]["points"]
    assert [p["n"] for p in points] == [16, 32] and all(p["linear_s"] > 0 for p in points)
    monkeypatch.setenv("POLYATTN_CROSSOVER", str(table))
    base.reload_crossover_table()
    try:
        expected = math.inf if row["n"] is None else row["n"]
        inputs_n = base.measured_crossover("cpu", 4, 2, False, "train")
        assert inputs_n == expected
    finally:
        monkeypatch.delenv("POLYATTN_CROSSOVER")
        base.reload_crossover_table()


def test_long_context_reports_the_goals(tmp_path):
    out = tmp_path / "lc.json"
    argv = ["long-context", "--configs", "poly3/4", "--lengths", "32,64", "--checks", "64", "--repeats", "1",
            "--json", str(out)]
    assert bench_main(argv) == 0
    report = json.loads(out.read_text())
    (result,) = report["results"]
    last = result["points"][-1]
    assert last["relative_error"] < 1e-5 and 0 < last["extra_bytes_per_head"] < 2**20
    assert any("auto within" in line for line in report["goals"])


def test_decode_writes_the_decode_rows(tmp_path):
    table, out = tmp_path / "crossover.json", tmp_path / "decode.json"
    argv = ["decode", "--configs", "poly1/4,poly2/4", "--lengths", "16,64", "--heads", "2", "--repeats", "1",
            "--steps", "2", "--model", "--prompts", "4", "--new-tokens", "3", "--write", str(table), "--json", str(out)]
    assert bench_main(argv) == 0
    report = json.loads(out.read_text())
    assert [(r["p"], r["d"]) for r in report["layer"]] == [(1, 4), (2, 4)]
    assert set(report["model"]["4"]) == {"sdpa", "poly3 kv", "poly3 recurrent", "poly3 recurrent from token 0"}
    rows = json.loads(table.read_text())["devices"][base.device_key(torch.device("cpu"))]["crossover"]
    assert {(r["p"], r["mode"], r["causal"]) for r in rows} == {(1, "decode", True), (2, "decode", True)}
