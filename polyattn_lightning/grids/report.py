"""``write_report(grid_dir)``: a grid's tables and figures in ``<grid>/report/``, and on the terminal the table and
every cell that does not count.

* ``table.md``: one row per group (every axis but the seed's): ``n`` finished seeds, mean ± sample standard
  deviation, the 95% t interval, the difference from the baseline paired by seed with its interval, the paper's
  number, and notes (the missing seeds); below it the method and every cell that was left out, with the reason.
* ``table.csv``: the same rows, numbers at full precision (Python's shortest exact float form), one column per axis.
* ``cells.csv``: every cell: labels, state, the value read from its metrics.json (empty when it does not count) and
  why not.
* ``report.json``: all of it for programs (groups with their seed values, paired differences, notes).
* ``figures/``: ``bars.png`` and, where the grid asks, ``scale-sweep.png`` (:mod:`.figures`).

Called at the end of ``polyattn grid`` and by ``polyattn grid report DIR``; it only reads the cells, so it can run
at any time, also while cells still train (they are listed as not finished).
"""

from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .figures import draw_figures
from .results import Cell, Group, Results, collect, seed_label
from .stats import LEVEL, Summary

REPORT_DIR = "report"
#: The table's fixed columns (the axes' columns come first); an axis may not take one of these names.
GROUP_COLUMNS = (
    "group", "n", "seeds", "missing", "mean", "std", "ci_low", "ci_high", "t", "level", "baseline", "diff_n",
    "diff_mean", "diff_std", "diff_low", "diff_high", "paper", "paper_reported", "paper_unit", "paper_model",
    "paper_activation",
)  # fmt: skip
CELL_COLUMNS = ("cell", "status", "value", "reason")


def _fixed(value: float) -> str:
    return f"{value:.4f}"


def _signed(value: float) -> str:
    return f"{value:+.4f}"


def _interval(summary: Summary | None, signed: bool = False) -> str:
    show = _signed if signed else _fixed
    if summary is None or summary.low is None:
        return "n=1: no interval" if summary is not None else ""
    return f"[{show(summary.low)}, {show(summary.high)}]"


def _difference_cell(group: Group) -> str:
    if group.is_baseline:
        return "baseline"
    if group.baseline is None:
        return ""
    paired = group.paired
    if paired.summary is None:
        return "no seed finished on both sides"
    summary = paired.summary
    if summary.low is None:
        return f"{_signed(summary.mean)} (one pair: no interval)"
    return f"{_signed(summary.mean)} {_interval(summary, signed=True)}, n={summary.n}"


def _paper_cell(group: Group, results: Results) -> str:
    if results.paper is None:
        return ""
    if group.paper is None:
        return "not reported"
    return f"{group.paper.reported:g} {group.paper.unit} ({group.paper.model}, {group.paper.activation})"


def _notes_cell(group: Group, results: Results) -> str:
    """The group's missing seeds with each cell's state (the reasons are listed below the table), and the counted
    seeds whose metrics.json says the run stayed at chance."""
    notes = []
    if group.missing:
        states = {
            seed_label(cell, results.seeds): cell.status
            if cell.status != "finished"
            else "finished without a usable value"
            for cell in group.cells
        }
        notes.append("missing " + ", ".join(f"{seed} ({states[seed]})" for seed in group.missing))
    at_chance = [seed_label(cell, results.seeds) for cell in group.cells if cell.value is not None and _at_chance(cell)]
    if at_chance:
        notes.append(f"at chance: {', '.join(at_chance)}")
    return "; ".join(notes)


def _at_chance(cell: Cell) -> bool:
    return bool((cell.metrics or {}).get("at_chance"))


def _escape(text: str) -> str:
    return text.replace("|", "\\|")


def markdown(results: Results) -> str:
    """The report's Markdown: a title, the table, then its notes (method, defaults taken, cells left out)."""
    counted, total = len(results.counted), len(results.cells)
    metric = f"`{results.metric}`" if results.metric else "no metric (no cell finished)"
    baseline = ", ".join(f"{name}={label}" for name, label in results.baseline.items())
    header = [_escape(axis.name) for axis in results.group_axes] or ["group"]
    header += ["n", "mean ± std", f"{LEVEL:.0%} CI (t)"]
    header += [f"vs {baseline}, paired by seed ({LEVEL:.0%} CI)"] if results.baseline else []
    header += ["paper"] if results.paper is not None else []
    header += ["notes"]
    lines = [
        f"# Grid `{results.name}`: {metric}, {results.use} value of each fit",
        "",
        (
            f"{counted} of {total} cells finished and counted. Mean ± sample standard deviation over seeds and the "
            f"{LEVEL:.0%} t interval of the mean (method below)."
        ),
        "",
        "| " + " | ".join(header) + " |",
        "| " + " | ".join("---:" if name == "n" else "---" for name in header) + " |",
    ]
    for group in results.groups:
        summary = group.summary
        row = [_escape(label) for label in group.key] or [group.name]
        row += [str(len(group.values))]
        if summary is None:
            row += ["no finished seed", ""]
        else:
            spread = "" if summary.std is None else f" ± {_fixed(summary.std)}"
            row += [_fixed(summary.mean) + spread, _interval(summary)]
        row += [_difference_cell(group)] if results.baseline else []
        row += [_paper_cell(group, results)] if results.paper is not None else []
        row += [_escape(_notes_cell(group, results))]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "## Notes", ""]
    lines += [f"- {note}" for note in method_notes(results)]
    left_out = results.not_counted
    if left_out:
        lines += ["", f"Not counted ({len(left_out)} of {total} cells):", ""]
        lines += [f"- `{cell.name}`: {_escape(cell.reason or cell.status)}" for cell in left_out]
    return "\n".join(lines) + "\n"


def _use_words(results: Results) -> str:
    return {
        "best": "the best value of each fit (metrics.json `best.value`)",
        "last": "the value at each fit's last validation (metrics.json `last.value`)",
        "final": "the last logged value of each fit (metrics.json `metrics`)",
    }[results.use]


def method_notes(results: Results) -> list[str]:
    """What the numbers are and which defaults were taken, one sentence per note."""
    level = f"{LEVEL:.0%}"
    metric = f"`{results.metric}`" if results.metric else "none yet (no cell finished and report.metric not set)"
    notes = [
        f"Metric: {metric}, {_use_words(results)}"
        + (f"; higher is better (mode {results.mode})." if results.mode == "max" else "")
        + (f"; lower is better (mode {results.mode})." if results.mode == "min" else "")
        + ("." if results.mode not in ("max", "min") else ""),
        (
            f"Interval: mean ± t · s / √n, t the {(1 + LEVEL) / 2:.3f} quantile of Student's t with n − 1 degrees "
            "of freedom, s the sample standard deviation (n − 1 divisor), n the group's finished seeds; with n = 1 "
            "there is no spread and no interval."
        ),
    ]
    if results.baseline:
        notes.append(
            f"Paired difference: for every seed that finished in both the group and its baseline, group − baseline; "
            f"the mean of those differences with the same {level} t interval over the n pairs. An interval that "
            f"excludes 0 is a difference the seeds do not explain."
        )
    notes += results.notes
    if results.chance is not None:
        notes.append(f"Chance: {results.chance:g} (the cells' metrics.json chance rate), dashed in the figures.")
    if any(cell.value is not None and _at_chance(cell) for cell in results.cells):
        notes.append(
            "At chance: the seeds whose metrics.json says `at_chance` (the best accuracy within noise of the chance "
            "rate: the run learned nothing measurable) count like the others and are named in the notes column."
        )
    if results.paper is not None:
        if results.metric is not None and not results.paper.compares_with(results.metric):
            notes.append(
                f"Paper: `{results.paper.key}` numbers are {results.paper.quantity}; the report's metric "
                f"{results.metric} is not that quantity, so none are shown."
            )
        else:
            notes.append(f"Paper: {results.paper.quantity}; source: {results.paper.source}.")
    missing = {seed for group in results.groups for seed in group.missing}
    if missing:
        notes.append(
            "Missing seeds make n smaller and the interval wider; a paired difference uses only the seeds both "
            "sides finished."
        )
    return notes


def _number(value: float | None) -> str:
    return "" if value is None else repr(float(value))


def _csv(columns: list[str], rows: list[dict[str, Any]]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def group_rows(results: Results) -> list[dict[str, Any]]:
    """The table's rows as CSV fields: labels, statistics at full precision, the paper's number."""
    rows = []
    for group in results.groups:
        summary, paired = group.summary, group.paired
        difference = paired.summary if paired is not None else None
        row = {axis.name: label for axis, label in zip(results.group_axes, group.key)}
        row.update(
            group=group.name,
            n=len(group.values),
            seeds=";".join(group.values),
            missing=";".join(group.missing),
            mean=_number(summary and summary.mean),
            std=_number(summary and summary.std),
            ci_low=_number(summary and summary.low),
            ci_high=_number(summary and summary.high),
            t=_number(summary and summary.t),
            level=LEVEL,
            baseline="(baseline)" if group.is_baseline else group.baseline or "",
            diff_n=difference.n if difference else "",
            diff_mean=_number(difference and difference.mean),
            diff_std=_number(difference and difference.std),
            diff_low=_number(difference and difference.low),
            diff_high=_number(difference and difference.high),
            paper=_number(group.paper and group.paper.value),
            paper_reported=_number(group.paper and group.paper.reported),
            paper_unit=group.paper.unit if group.paper else "",
            paper_model=group.paper.model if group.paper else "",
            paper_activation=group.paper.activation if group.paper else "",
        )
        rows.append(row)
    return rows


def _columns(results: Results, fixed: tuple[str, ...]) -> list[str]:
    axes = [axis.name for axis in results.group_axes]
    if results.seeds is not None and fixed is CELL_COLUMNS:
        axes.append(results.seeds.name)
    clash = set(axes) & set(fixed)
    if clash:
        raise ConfigError(f"axis name {min(clash)!r} is also a report column ({', '.join(fixed)}); rename it")
    return axes + list(fixed)


def cell_rows(results: Results) -> list[dict[str, Any]]:
    return [
        {**cell.labels, "cell": cell.name, "status": cell.status, "value": _number(cell.value),
         "reason": cell.reason or ""}
        for cell in results.cells
    ]  # fmt: skip


def _plain(record: Any) -> dict[str, Any] | None:
    return None if record is None else asdict(record)


def as_json(results: Results, figures: list[Path]) -> dict[str, Any]:
    """Everything the tables say, for programs."""
    return {
        "schema": 1,
        "grid": results.name,
        "metric": results.metric,
        "use": results.use,
        "mode": results.mode,
        "level": LEVEL,
        "seeds": results.seeds.name if results.seeds else None,
        "axes": [axis.name for axis in results.group_axes],
        "baseline": results.baseline,
        "paper": {"key": results.paper.key, "quantity": results.paper.quantity, "source": results.paper.source}
        if results.paper
        else None,
        "chance": results.chance,
        "groups": [
            {
                "name": group.name,
                "labels": dict(zip([axis.name for axis in results.group_axes], group.key)),
                "values": group.values,
                "missing": group.missing,
                "summary": _plain(group.summary),
                "is_baseline": group.is_baseline,
                "baseline": group.baseline,
                "paired": _plain(group.paired),
                "paper": _plain(group.paper),
            }
            for group in results.groups
        ],
        "cells": [
            {
                "name": cell.name,
                "labels": dict(cell.labels),
                "status": cell.status,
                "value": cell.value,
                "reason": cell.reason,
            }
            for cell in results.cells
        ],
        "notes": method_notes(results),
        "figures": [str(path.relative_to(results.grid_dir / REPORT_DIR)) for path in figures],
    }


def _write(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` whole or not at all (a temporary file renamed over it)."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)
    return path


def write_report(grid_dir: Path) -> Path:
    """Write ``<grid_dir>/report/`` (tables, report.json, figures) from the cells' metrics files; return the folder.

    The terminal shows the table, every cell that does not count and why, and what was written.
    """
    grid_dir = Path(grid_dir)
    results = collect(grid_dir)
    folder = grid_dir / REPORT_DIR
    folder.mkdir(exist_ok=True)
    table = markdown(results)
    _write(folder / "table.md", table)
    _write(folder / "table.csv", _csv(_columns(results, GROUP_COLUMNS), group_rows(results)))
    _write(folder / "cells.csv", _csv(_columns(results, CELL_COLUMNS), cell_rows(results)))
    figures = draw_figures(results, folder / "figures")
    _write(folder / "report.json", json.dumps(as_json(results, figures), indent=2) + "\n")
    _say(results, table, folder, figures)
    return folder


def _say(results: Results, table: str, folder: Path, figures: list[Path]) -> None:
    rows = [line for line in table.splitlines() if line.startswith("|")]
    print(f"report of grid {results.name}: {len(results.counted)} of {len(results.cells)} cells counted", flush=True)
    print("\n".join(rows), flush=True)
    for cell in results.not_counted:
        print(f"  not counted: {cell.name}: {cell.reason or cell.status}", flush=True)
    written = ["table.md", "table.csv", "cells.csv", "report.json"] + [str(p.relative_to(folder)) for p in figures]
    print(f"wrote {folder}/: {', '.join(written)}", flush=True)
