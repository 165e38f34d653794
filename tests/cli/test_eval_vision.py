"""``polyattn eval`` of a vision run: ``lightning test`` of its checkpoint through the project's CLI, its logged
metrics the results."""

from __future__ import annotations

import json
from pathlib import Path

from test_first_hour import run, write_config, write_folder

from polyattn_lightning.harness.table import format_value


def test_a_vision_run_is_evaluated_by_its_own_test_metrics(tmp_path):
    write_config(tmp_path / "folder.yaml", write_folder(tmp_path / "imgs", train=2, val=2))
    short = ["--trainer.limit_train_batches", "1", "--trainer.max_epochs", "1", "--trainer.enable_progress_bar", "false"]
    run_dir = Path("runs/classification/folder/version_0")
    fitted, evaluated, tested = run(
        tmp_path,
        ["fit", "--config", "folder.yaml", *short],
        ["eval", f"vit={run_dir}", "--out", "evaluated"],
        ["test", "--ckpt_path", str(run_dir / "checkpoints" / "last.ckpt"), "--trainer.enable_progress_bar", "false"],
    )
    assert fitted["rc"] == 0 and tested["rc"] == 0, fitted["output"] + tested["output"]
    assert evaluated["rc"] == 0, evaluated["output"]
    metrics = json.loads((tmp_path / "evaluated" / "vit.json").read_text())["results"]["test"]
    assert "test/top1" in metrics, metrics
    [own] = (tmp_path / run_dir).glob("test_last*/metrics.json")  # the run's own `lightning test`
    assert metrics == json.loads(own.read_text())["metrics"]
    assert list((tmp_path / run_dir).glob("test_best-epoch000*/metrics.json"))  # eval tested the best checkpoint
    table = (tmp_path / "evaluated" / "table.md").read_text()
    assert table.splitlines()[0] == "| task | metric | vit |"
    assert f"| test | test/top1 | {format_value(metrics['test/top1'])} |" in table
