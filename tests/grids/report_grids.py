"""Grid folders for the report's tests, written by hand as GRID_DESIGN's layout defines them (no training): grid.json,
and per cell cell.json, metrics.json (the end-of-fit schema) and optionally the run's config.yaml."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import torch
import yaml


def metrics(value: float, status: str = "finished", monitor: str = "val/top1", **extra: Any) -> dict[str, Any]:
    """A metrics.json body whose monitored metric's best value is ``value`` (last and final a little lower)."""
    body = {
        "schema": 1,
        "status": status,
        "verb": "fit",
        "monitor": monitor,
        "mode": "max",
        "best": {"value": value, "step": 120, "epoch": 3, "checkpoint": "checkpoints/best.ckpt"},
        "last": {"value": value - 0.001, "step": 150, "epoch": 4},
        "metrics": {"val/top1": value - 0.001, "val/loss": 1.0 - value, "test/top1": value - 0.002},
        "chance": {"rate": 0.1, "source": "majority class of the validation split"},
        "at_chance": False,
        "steps": 150,
        "epochs": 5,
        "elapsed_s": 40.2,
        "config": "config.yaml",
        "error": None,
    }
    body.update(extra)
    return body


def write_grid(
    root: Path,
    axes: dict[str, tuple[str, dict[str, Any]]],
    report: dict[str, Any],
    cells: dict[str, dict[str, Any] | None],
    configs: dict[str, dict[str, Any]] | None = None,
    logs: dict[str, str] | None = None,
    name: str = "test-grid",
) -> Path:
    """A grid folder under ``root``: ``axes`` name -> (key, {label: value}) in order; ``cells`` cell name -> its
    metrics.json body (None: no metrics.json; an interrupted one comes with its checkpoint); ``configs`` cell name ->
    the run's resolved config (config.yaml); ``logs`` cell name -> its cell.log text."""
    configs, logs = configs or {}, logs or {}
    entries = []
    for combination in itertools.product(*[list(values.items()) for _, values in axes.values()]):
        labels = {axis: label for axis, (label, _) in zip(axes, combination)}
        settings = {axes[axis][0]: value for axis, (_, value) in zip(axes, combination)}
        cell_name = "/".join(labels.values())
        entries.append({"name": cell_name, "labels": labels, "settings": settings, "dir": f"cells/{cell_name}"})
        folder = root / "cells" / cell_name
        folder.mkdir(parents=True)
        (folder / "cell.json").write_text(json.dumps({
            "name": cell_name, "labels": labels, "settings": settings, "command": ["polyattn", "fit"],
            "attempts": 0 if cells.get(cell_name) is None and cell_name not in logs else 1, "log": "cell.log",
        }))  # fmt: skip
        if cell_name in logs:
            (folder / "cell.log").write_text(logs[cell_name])
        if cells.get(cell_name) is not None:
            (folder / "metrics.json").write_text(json.dumps(cells[cell_name]))
            if cells[cell_name]["status"] == "interrupted":  # an interrupted fit leaves the checkpoint it resumes from
                (folder / "checkpoints").mkdir()
                torch.save({"global_step": 60}, folder / "checkpoints" / "last.ckpt")
        if cell_name in configs:
            (folder / "config.yaml").write_text(yaml.safe_dump(configs[cell_name]))
    grid = {
        "schema": 1,
        "name": name,
        "base": "base.yaml",
        "axes": [{"name": axis, "key": key, "labels": list(values)} for axis, (key, values) in axes.items()],
        "report": report,
        "cells": entries,
    }
    (root / "grid.json").write_text(json.dumps(grid, indent=2))
    return root
