"""The models side by side: one row per task and metric, one column per model, as ``polyattn eval`` prints it and
writes it (``table.md``)."""

from __future__ import annotations

import math
from typing import Any

#: lm-eval's per-task entries that are not metrics.
NOT_METRICS = ("name", "alias", "sample_len", "samples")


def metrics(result: dict[str, Any]) -> dict[tuple[str, str], float]:
    """``(task, metric) -> value`` of one model's results (lm-eval's ``results`` dict, ``metric,filter`` keys
    shown without the ``none`` filter; standard errors left out)."""
    rows = {}
    for task, entries in result.get("results", {}).items():
        for key, value in entries.items():
            name, _, kind = key.partition(",")
            if key in NOT_METRICS or name.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            rows[(task, name if kind in ("", "none") else f"{name} ({kind})")] = float(value)
    return rows


def side_by_side(results: dict[str, dict[str, Any]]) -> str:
    """A Markdown table: ``task | metric | <model> | <model> ...``; a value a model lacks shows as ``-``."""
    columns = {label: metrics(result) for label, result in results.items()}
    rows = list(dict.fromkeys(row for values in columns.values() for row in values))
    lines = [
        "| task | metric | " + " | ".join(columns) + " |",
        "|---|---|" + "---:|" * len(columns),
    ]
    for task, metric in rows:
        cells = [format_value(values.get((task, metric))) for values in columns.values()]
        lines.append(f"| {task} | {metric} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_value(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.4f}" if math.isfinite(value) and abs(value) < 1e5 else f"{value:.4g}"
