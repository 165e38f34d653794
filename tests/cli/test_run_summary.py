"""The end of a run as the user meets it (``polyattn fit`` as a process, the progress bar off): a short table of the
monitored metric's best and last value and the other metrics, and ``metrics.json`` in the run folder, checked against
what the run logged to TensorBoard; the status of a run stopped by Ctrl-C or an exception; a resumed run's file; the
one line of a fit that ends at the chance rate."""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

import numpy as np
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_ctrl_c import RUNS, SHORT, ctrl_c
from test_first_hour import project, run, write_config  # noqa: F401  (the fixture)

#: the keys of metrics.json (docs/training.md, "What the end of a run says")
KEYS = {"schema", "status", "verb", "monitor", "mode", "best", "last", "metrics", "chance", "at_chance", "steps",
        "epochs", "elapsed_s", "config", "error"}


def logged(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar the run folder's TensorBoard files hold (a resumed run's files too): tag -> [(step, value)]."""
    events = EventAccumulator(str(run_dir))
    events.Reload()
    return {tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def expected_scores(scalars: dict[str, list[tuple[int, float]]], monitor: str = "val/top1") -> tuple[dict, dict]:
    """The best (first of the highest) and last logged ``monitor`` with its step and epoch (TensorBoard's ``epoch``
    scalar at that step). Lightning logs a validation at the step before the one the optimizer steps done count
    (``global_step``, the checkpoint's step, what metrics.json says)."""
    epochs = dict(scalars["epoch"])
    points = scalars[monitor]
    best_step, best_value = max(points, key=lambda point: point[1])  # max() keeps the first of equal values
    last_step, last_value = points[-1]
    return ({"value": best_value, "step": best_step + 1, "epoch": int(epochs[best_step])},
            {"value": last_value, "step": last_step + 1, "epoch": int(epochs[last_step])})


def table_row(output: str, name: str) -> list[str]:
    """The cells of the end-of-run table's row for ``name`` (cells are two or more spaces apart)."""
    [line] = [line for line in output.splitlines() if line.startswith(f"  {name} ")]
    return [cell.strip() for cell in line.strip().split("  ") if cell.strip()]


def test_fit_ends_with_a_table_and_metrics_file_of_what_it_logged_or_of_its_failure(project):  # noqa: F811
    fit = ["fit", "--config", "folder.yaml", *SHORT]
    fail = '--trainer.callbacks+={"class_path": "training_helpers.KillAt", "init_args": {"step": 4}}'
    result, failed = run(project, [*fit, "--model.test_after_fit", "true"], [*fit, fail])
    output, run_dir = result["output"], project / RUNS / "version_0"
    assert result["rc"] == 0, output
    summary = json.loads((run_dir / "metrics.json").read_text())
    assert set(summary) == KEYS
    scalars = logged(run_dir)
    best, last = expected_scores(scalars)
    assert summary["best"] == {**best, "checkpoint": f"checkpoints/best-epoch{best['epoch']:03d}.ckpt"}
    assert (run_dir / summary["best"]["checkpoint"]).is_file()
    assert summary["last"] == last
    evaluated = {tag: points[-1][1] for tag, points in scalars.items() if tag.startswith(("val/", "test/"))}
    assert summary["metrics"] == evaluated
    assert {"val/top1", "val/loss", "test/top1", "test/loss"} <= set(summary["metrics"])  # the test after fit's too
    assert {key: summary[key] for key in ("schema", "status", "verb", "monitor", "mode", "steps", "epochs", "config",
                                          "error")} == {
        "schema": 1, "status": "finished", "verb": "fit", "monitor": "val/top1", "mode": "max", "steps": 9,
        "epochs": 3, "config": "config.yaml", "error": None}
    assert summary["chance"] == {"rate": 1 / 3, "source": "majority class of 6 validation images", "samples": 6,
                                 "class": "cat"}
    assert summary["at_chance"] == (best["value"] <= 1 / 3 + 2 * math.sqrt(1 / 3 * 2 / 3 / 6))

    # what the user reads, with the progress bar off
    assert "fit finished: 9 steps, 3 epochs, " in output
    assert table_row(output, "metric") == ["metric", "best (step, epoch)", "last (step, epoch)"]
    assert table_row(output, "val/top1 (max)") == [
        "val/top1 (max)", f"{best['value']:.4f} ({best['step']}, {best['epoch']})",
        f"{last['value']:.4f} ({last['step']}, {last['epoch']})"]
    for tag in ("val/loss", "test/top1", "test/loss"):
        assert table_row(output, tag) == [tag, f"{summary['metrics'][tag]:.4f}"]
    assert f"  best checkpoint: {RUNS / 'version_0' / summary['best']['checkpoint']}" in output.splitlines()
    assert f"  written: {RUNS / 'version_0' / 'metrics.json'}" in output.splitlines()

    # an exception in a step (before step 4): the file says so, with the error
    assert failed["rc"] == 1, failed["output"]
    summary = json.loads((project / RUNS / "version_1" / "metrics.json").read_text())
    assert (summary["status"], summary["steps"], summary["error"]) == ("failed", 4, "Killed")
    assert summary["last"] == expected_scores(logged(project / RUNS / "version_1"))[1]  # epoch 0's validation
    assert "fit failed: 4 steps, 1 epochs, " in failed["output"] and "; Killed" in failed["output"]


def test_interrupted_and_resumed_runs_say_how_they_ended(project):  # noqa: F811
    fit = ["fit", "--config", "folder.yaml", *SHORT]
    [stopped] = run(project, [*fit, ctrl_c()])

    assert stopped["rc"] == 130, stopped["output"]
    stopped_dir = project / RUNS / "version_0"
    summary = json.loads((stopped_dir / "metrics.json").read_text())
    best, last = expected_scores(logged(stopped_dir))
    # the Ctrl-C came in epoch 1's validation, which the resumed run runs again: only epoch 0's counts
    assert (summary["status"], summary["steps"], summary["error"]) == ("interrupted", 6, None)
    assert summary["last"] == last and last["epoch"] == 0
    assert "fit interrupted: 6 steps, 1 epochs, " in stopped["output"]

    # validating the stopped run's best checkpoint (epoch 0's) scores what epoch 0's validation logged
    interrupted_best = json.loads((stopped_dir / "metrics.json").read_text())["best"]
    ckpt = stopped_dir / interrupted_best["checkpoint"]
    [line] = [line for line in stopped["output"].splitlines() if line.startswith("Ctrl-C: saved")]
    validated, resumed = run(project, ["validate", "--ckpt_path", str(ckpt)],
                             shlex.split(line.split("resume with: ", 1)[1])[1:])
    assert validated["rc"] == 0, validated["output"]
    summary = json.loads((stopped_dir / "validate_best-epoch000" / "metrics.json").read_text())
    assert (summary["verb"], summary["monitor"], summary["steps"], summary["epochs"]) == ("validate", "val/top1", 3, 0)
    evaluated = {"checkpoint": str(ckpt)}
    assert summary["best"] == summary["last"] | evaluated == interrupted_best | evaluated
    assert "validate finished: a checkpoint of step 3, epoch 0, " in validated["output"]

    assert resumed["rc"] == 0, resumed["output"]
    summary = json.loads((stopped_dir / "metrics.json").read_text())  # rewritten
    scalars = logged(stopped_dir)  # both runs' event files
    best, last = expected_scores(scalars)
    assert (summary["status"], summary["steps"], summary["epochs"], summary["config"]) == (
        "finished", 9, 3, "config.1.yaml")
    assert summary["best"] == {**best, "checkpoint": f"checkpoints/best-epoch{best['epoch']:03d}.ckpt"}
    assert summary["last"] == last and len(scalars["val/top1"]) == 3  # epoch 0 from before the Ctrl-C
    assert summary["metrics"] == {tag: points[-1][1] for tag, points in scalars.items() if tag.startswith("val/")}


def write_random_labels(root: Path, counts: dict[str, tuple[int, int]]) -> Path:
    """``train/`` and ``val/`` folders of noise images, ``counts[class] = (train, val)``: labels that nothing in
    the images tells."""
    rng = np.random.default_rng(0)
    for name, sizes in counts.items():
        for split, count in zip(("train", "val"), sizes):
            for i in range(count):
                path = root / split / name / f"{i}.png"
                path.parent.mkdir(parents=True, exist_ok=True)
                Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(path)
    return root


def test_a_fit_at_the_chance_rate_says_so_in_one_line(tmp_path):
    write_config(tmp_path / "shapes.yaml", write_random_labels(tmp_path / "shapes", {
        "circle": (8, 12), "square": (4, 6), "triangle": (4, 6)}))
    fit = ["fit", "--config", "shapes.yaml", "--trainer.max_epochs", "2", "--trainer.enable_progress_bar", "false"]
    # the light augmentation chosen for 16 images, then DeiT's RandAugment and random erasing, given
    result, heavy = run(tmp_path, fit, [*fit, "--data.augment.auto_augment", "rand-m9-mstd0.5-inc1"])
    output = result["output"]
    assert result["rc"] == 0, output
    summary = json.loads((tmp_path / "runs" / "classification" / "shapes" / "version_0" / "metrics.json").read_text())
    best = summary["best"]["value"]
    assert summary["chance"]["rate"] == 0.5 and summary["at_chance"] is True
    assert best <= 0.5 + 2 * math.sqrt(0.25 / 24)
    [line] = [line for line in output.splitlines() if "the chance rate" in line]
    tips = (
        "a lower learning rate (--model.optim.lr 5e-05; this run: 0.0005); "
        "more epochs (--trainer.max_epochs 6; this run: 2); "
        "softmax attention to compare (--model.attention softmax; this run: poly3)"
    )
    assert line == (
        f"val/top1 ended at the chance rate (0.500, majority class of 24 validation images): best {best:.3f}; try "
        + tips
    )
    assert heavy["rc"] == 0, heavy["output"]
    [heavy_line] = [line for line in heavy["output"].splitlines() if "the chance rate" in line]
    assert heavy_line.endswith(
        "; try lighter augmentation on small data (--data.augment.auto_augment null --data.augment.re_prob 0); " + tips
    ), heavy_line
    assert output.splitlines().index(line) > output.splitlines().index("  chance rate: 0.5000 (majority class of "
                                                                         "24 validation images)")
