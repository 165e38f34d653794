"""``python -m polyattn_lightning.bench timm`` on a tiny model: it runs the three steps and writes JSON."""
from __future__ import annotations

import json

from polyattn_lightning.bench.__main__ import main


def test_timm_bench_runs_and_writes_json(tmp_path, capsys):
    out = tmp_path / "timm.json"
    assert main(["timm", "--models", "test_vit", "--img-size", "32", "--batch", "2", "--repeats", "2",
                 "--json", str(out)]) == 0
    [result] = json.loads(out.read_text())["results"]
    assert set(result["seconds"]) == {"timm", "softmax", "poly3"}
    assert all(len(times) == 2 and min(times) > 0 for times in result["seconds"].values())
    assert result["switched_softmax_over_timm"] == result["median_s"]["softmax"] / result["median_s"]["timm"]
    assert "test_vit 32px batch 2" in capsys.readouterr().out
