"""The FSDP benchmark command end to end at the tiny size: one 2-rank launch (DDP, sharded, sharded resume) and the
one-process runs, with every target of the sharding issue checked and reported."""
from __future__ import annotations

import json

import pytest

from polyattn_lightning.bench.__main__ import main as bench_main

pytestmark = pytest.mark.slow


def test_fsdp_bench_meets_its_targets_at_the_tiny_size(tmp_path, capsys):
    out = tmp_path / "fsdp.json"
    code = bench_main(["fsdp", "--size", "tiny", "--steps", "4", "--save-at", "2", "--json", str(out),
                       "--work", str(tmp_path / "work")])
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert code == 0 and all(report["verdicts"].values()), printed
    assert report["memory_ratio"] <= 0.6 and report["resumed_2_ranks_bitwise"] is True
    per_rank = report["held_bytes"]
    assert len(per_rank["ddp"]) == len(per_rank["fsdp"]) == 2
    assert "| params + AdamW moments per rank, FSDP2 |" in printed and "MET  resumed on 2 ranks bit for bit" in printed
    differences = report["differences"]
    assert differences["fsdp_vs_ddp"]["largest"] <= 1e-5 and differences["control_halves_vs_single"]["largest"] > 0
    assert 0 < differences["fsdp_vs_single"]["relative_to_update"] < 1e-4
    assert "load_average_before" in report["machine"] and report["command"].startswith("python -m")
