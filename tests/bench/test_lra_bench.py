"""``python -m polyattn_lightning.bench lra``: runs end to end, and poly3's training step holds no N x N tensor."""
from __future__ import annotations

import json

import torch

from polyattn_lightning.attention import attention
from polyattn_lightning.bench.__main__ import main as bench_main
from polyattn_lightning.bench.lra import retrieval4k


def test_lra_bench_runs_and_writes_json(tmp_path, capsys):
    out = tmp_path / "lra.json"
    assert bench_main(["lra", "--batch", "2", "--repeats", "1", "--length", "128", "--retrieval-batch", "1",
                       "--retrieval-length", "128", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["throughput"]) == {"text", "retrieval"}
    assert set(report["throughput"]["retrieval"]["cases"]) == {
        "softmax", "poly3", "poly1", "softmax+drop0", "poly3+drop0", "poly1+drop0"}
    assert report["throughput"]["text"]["cases"]["softmax"]["ratio"]["sequences_per_s"] == 1.0
    assert "| poly1+drop0 |" in capsys.readouterr().out


def test_poly3_retrieval_step_memory_grows_linearly_with_length_also_under_bf16():
    """From 1024 to 2048 tokens per document an N x N tensor grows 4x (and would dominate: 16 -> 64 MiB in fp32
    for one pair and 2 heads), the model's activations 2x."""
    result = retrieval4k(batch_size=1, length=2048)
    for label in ("poly3", "poly3+bf16"):
        assert result[label]["peak_growth"] < 2.5, (label, result[label])
        assert result[label]["2048"]["peak_over_nxn_fp32"] < 1.0


def test_lra_bench_pathx_part_trains_on_a_generated_set(tmp_path, monkeypatch, capsys):
    """The Path-X part at 32 px (the full run is 128 px, hours): the set is drawn into the cache, the steps run,
    the kernel auto picks is reported."""
    q = torch.randn(1, 1, 4, 8)
    attention(q, q, q, "poly3")  # loads the C++ kernels from their usual cache before the cache folder moves
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = tmp_path / "pathx.json"
    assert bench_main(["lra", "--parts", "pathx", "--pathx-steps", "3", "--pathx-batch", "2", "--pathx-images", "10",
                       "--pathx-resolution", "32", "--json", str(out)]) == 0
    result = json.loads(out.read_text())["pathx"]
    assert (result["tokens"], result["steps"], len(result["losses"])) == (1024, 3, 3)
    assert result["kernel"] in ("fused_cpu", "blocked") or "poly" in result["kernel"]
    assert all(loss == loss and loss > 0 for loss in result["losses"]) and result["peak_bytes"] > 0
    assert list((tmp_path / "cache" / "polyattn_lightning" / "lra").glob("pathfinder32-*"))
    assert "Path-X: 3 training steps of 2 x 1024 tokens" in capsys.readouterr().out
