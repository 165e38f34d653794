"""A grid folder's results: every cell's value of the report's metric, the cells grouped over seeds, and their
statistics (what :mod:`.report` writes as tables and :mod:`.figures` draws).

Read from the folder alone: ``grid.json`` (the axes, the cells, the grid file's ``report:`` settings) and each cell's
``metrics.json`` (written by the fit itself; no log is scraped). Only the cells that :func:`.folder.cell_state` finds
finished (their ``metrics.json`` says so) count; every other cell (running, interrupted, failed, not started, finished
without the metric) is listed with its state and why, so a missing seed is never silent. The ``report:`` settings are
checked by :func:`.spec.read_report`, as the grid file's were.

A group is the cells that share every label but the seed axis's (``poly3-scaled/seed1``, ``/seed2``, ``/seed3`` are
the group ``poly3-scaled``). Each group is compared with its baseline group (the same labels, with the baseline's
label on the baseline's axes: with ``baseline: {attention: softmax}``, ``vit_b/poly3`` against ``vit_b/softmax``)
seed by seed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError, DataError, MissingPathError, closest_option
from .folder import CELL_LOG, FINISHED, GRID_JSON, METRICS, cell_state, read_json
from .paper import PaperTable, PaperValue, paper_table
from .spec import Axis, read_report, seed_axis, sweep_axes
from .stats import Paired, Summary, paired_difference, summarize

#: The seed label of a cell in a grid without a seed axis (each group is one run).
SINGLE_RUN = "run"
#: The label a baseline defaults to when ``report.baseline`` is not set.
DEFAULT_BASELINE = "softmax"


@dataclass(frozen=True)
class FigureSpec:
    """``bars`` (always drawn) or ``scale-sweep``: the metric against axis ``x`` (log scale), a line per ``lines``
    label (one line without it)."""

    kind: str
    x: str | None = None
    lines: str | None = None


@dataclass(frozen=True)
class Cell:
    """One cell as the report sees it; ``value`` is None when the cell does not count, and ``reason`` says why."""

    name: str
    labels: Mapping[str, str]
    settings: Mapping[str, Any]
    dir: Path
    status: str
    metrics: Mapping[str, Any] | None
    value: float | None = None
    reason: str | None = None


@dataclass
class Group:
    """The cells sharing every label but the seed's: their values by seed label, the missing seeds and why."""

    key: tuple[str, ...]
    name: str
    cells: list[Cell]
    values: dict[str, float] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)
    summary: Summary | None = None
    is_baseline: bool = False
    baseline: str | None = None  # the baseline group's name (None: no baseline, or this group is it)
    paired: Paired | None = None
    paper: PaperValue | None = None


@dataclass
class Results:
    grid_dir: Path
    name: str
    metric: str | None
    use: str
    mode: str | None
    axes: list[Axis]
    seeds: Axis | None
    group_axes: list[Axis]
    baseline: dict[str, str]
    cells: list[Cell]
    groups: list[Group]
    figures: list[FigureSpec]
    paper: PaperTable | None
    chance: float | None
    notes: list[str]

    @property
    def counted(self) -> list[Cell]:
        return [cell for cell in self.cells if cell.value is not None]

    @property
    def not_counted(self) -> list[Cell]:
        return [cell for cell in self.cells if cell.value is None]


def _figures(report: Mapping[str, Any], group_axes: list[Axis], grid_file: str) -> list[FigureSpec]:
    """Bars always; with ``figure: scale-sweep`` also the sweep over the axes ``report.x`` and ``report.lines``
    (by default the axes named ``scale`` and ``length``; both axes other than the seed's)."""
    if report.get("figure", "bars") == "bars":
        return [FigureSpec("bars")]
    return [FigureSpec("bars"), FigureSpec("scale-sweep", *sweep_axes(report, group_axes, grid_file))]


def _seeds_axis(report: Mapping[str, Any], axes: list[Axis], grid_file: str, notes: list[str]) -> Axis | None:
    """The seed axis (``spec.seed_axis``), with a note where report.seeds does not name it."""
    axis = seed_axis(report, axes, grid_file)
    if report.get("seeds"):
        return axis
    if axis is not None:
        notes.append(f"Seeds: the axis {axis.name!r} (report.seeds not set; it sets {axis.key}).")
    else:
        notes.append(
            "Seeds: no seed axis (report.seeds not set, no axis sets seed_everything): each cell is its own group."
        )
    return axis


def _baseline(report: Mapping[str, Any], group_axes: list[Axis], notes: list[str]) -> dict[str, str]:
    """``report.baseline`` (checked by ``spec.read_report``); unset, the first axis with a ``softmax`` label (said in
    notes)."""
    baseline = report.get("baseline")
    if baseline is None:
        for axis in group_axes:
            if DEFAULT_BASELINE in axis.labels:
                notes.append(
                    f"Baseline: {axis.name}={DEFAULT_BASELINE} (report.baseline not set; the axis label "
                    f"{DEFAULT_BASELINE!r})."
                )
                return {axis.name: DEFAULT_BASELINE}
        notes.append("Baseline: none (report.baseline not set and no axis has a 'softmax' label): no differences.")
        return {}
    return {name: str(label) for name, label in baseline.items()}


def _read_cell(grid_dir: Path, entry: Mapping[str, Any]) -> Cell:
    """The cell as grid.json lists it, with its state (``folder.cell_state``) and its metrics.json; a cell that
    does not count says its state, why, and its log where it has one."""
    folder = grid_dir / entry["dir"]
    state = cell_state(folder)
    why = state.detail.removeprefix(f"{state.state}: ")
    reason = None if state.state == FINISHED else f"{state.state}: {why}" if why else state.state
    log = folder / CELL_LOG
    if reason and log.is_file():
        reason += f"; log: {log.relative_to(grid_dir)}"
    settings = dict(entry.get("settings") or {})
    metrics = read_json(folder / METRICS)
    return Cell(entry["name"], dict(entry["labels"]), settings, folder, state.state, metrics, reason=reason)


def _metric(report: Mapping[str, Any], cells: list[Cell], grid_file: Path) -> tuple[str | None, str | None]:
    """The report's metric (``report.metric``, else the cells' monitored metric) and its mode (max/min)."""
    finished = [cell for cell in cells if cell.status == FINISHED]
    monitors = {cell.metrics["monitor"]: cell.name for cell in finished if cell.metrics.get("monitor")}
    modes = {cell.metrics.get("mode") for cell in finished} - {None}
    mode = modes.pop() if len(modes) == 1 else None
    metric = report.get("metric")
    use = report.get("use", "best")
    if metric is None:
        if len(monitors) > 1:
            named = ", ".join(f"{name} monitors {monitor}" for monitor, name in monitors.items())
            raise ConfigError(f"{grid_file}: the cells monitor different metrics ({named}); set report.metric")
        if finished and not monitors:
            raise ConfigError(
                f"{grid_file}: the cells' metrics.json name no monitored metric; set report.metric "
                "and report.use: final"
            )
        return (next(iter(monitors)) if monitors else None), mode
    if use in ("best", "last"):
        other = {monitor: name for monitor, name in monitors.items() if monitor != metric}
        if other:
            monitor, name = next(iter(other.items()))
            raise ConfigError(
                f"{grid_file}: report.use {use!r} reads the {use} value of the monitored metric, and cell {name} "
                f"monitors {monitor}, not {metric}; for the last logged {metric} set report.use: final"
            )
    if finished and not any(metric in (cell.metrics.get("metrics") or {}) for cell in finished) and use == "final":
        logged = sorted({key for cell in finished for key in cell.metrics.get("metrics") or {}})
        closest = closest_option(metric, logged)
        hint = f" (did you mean {closest!r}?)" if closest else ""
        raise ConfigError(
            f"{grid_file}: report.metric {metric!r}{hint} is in no finished cell's metrics.json; "
            f"logged: {', '.join(logged) or 'nothing'}"
        )
    return metric, (mode if metric in monitors else None)


def _value(cell: Cell, metric: str, use: str) -> Cell:
    """The finished cell with its value of ``metric`` (``use``: best, last or final), or the reason it has none."""
    if cell.status != FINISHED:
        return cell
    if use == "final":
        value = (cell.metrics.get("metrics") or {}).get(metric)
        where = f"metrics[{metric!r}]"
    else:
        value = (cell.metrics.get(use) or {}).get("value")
        where = f"{use}.value"
    if value is None:
        return replace(cell, reason=f"finished, but its metrics.json has no {where}")
    if not math.isfinite(float(value)):
        return replace(cell, reason=f"finished, but its {where} is {value} (diverged?): not counted")
    return replace(cell, value=float(value))


def _trained_model(cell: Cell) -> tuple[str | None, Any]:
    """The timm model name and attention the cell trained: its saved config.yaml, else its grid settings."""
    config_file = cell.dir / ((cell.metrics or {}).get("config") or "config.yaml")
    if config_file.is_file():
        config = yaml.safe_load(config_file.read_text()) or {}
        model = (config.get("model") or {}).get("init_args") or {}
        return model.get("model_name"), model.get("attention")

    def setting(name: str) -> Any:
        return cell.settings.get(f"model.init_args.{name}", cell.settings.get(f"model.{name}"))

    return setting("model_name"), setting("attention")


def _chance(cells: list[Cell], metric: str | None) -> float | None:
    """The chance rate all counted cells state for their monitored metric, when that is the report's metric."""
    rates = {
        (cell.metrics.get("chance") or {}).get("rate") if cell.metrics.get("monitor") == metric else None
        for cell in cells
    }
    rate = rates.pop() if len(rates) == 1 else None
    return float(rate) if rate is not None else None


def collect(grid_dir: Path) -> Results:
    """Read the grid folder ``grid_dir`` and compute every group's statistics; user errors name the file and key."""
    grid_dir = Path(grid_dir)
    grid_file = grid_dir / GRID_JSON
    if not grid_file.is_file():
        raise MissingPathError(
            f"{grid_dir}: no {GRID_JSON} here; a grid's folder (as `polyattn grid GRID.yaml` "
            f"writes it) holds {GRID_JSON} and cells/"
        )
    try:
        grid = json.loads(grid_file.read_text())
    except (OSError, ValueError) as error:
        raise DataError(f"{grid_file}: cannot read the grid file: {error}") from None
    if grid.get("schema") != 1:
        raise DataError(f"{grid_file}: schema {grid.get('schema')!r}; this version reads schema 1")
    axes = [
        Axis(a["name"], a["key"], tuple(str(label) for label in a["labels"]), tuple(a.get("values") or ()))
        for a in grid["axes"]
    ]
    report = read_report(grid.get("report") or {}, axes, str(grid_file))
    notes: list[str] = []
    seeds = _seeds_axis(report, axes, str(grid_file), notes)
    group_axes = [axis for axis in axes if axis is not seeds]
    baseline = _baseline(report, group_axes, notes)
    figures = _figures(report, group_axes, str(grid_file))
    cells = [_read_cell(grid_dir, entry) for entry in grid["cells"]]
    metric, mode = _metric(report, cells, grid_file)
    use = report.get("use", "best")
    if metric is not None:
        cells = [_value(cell, metric, use) for cell in cells]
    paper = paper_table(report["paper"], f"{grid_file}: report.paper") if report.get("paper") else None
    groups = _groups(cells, seeds, group_axes)
    _compare(groups, group_axes, baseline)
    if paper is not None and (metric is None or paper.compares_with(metric)):  # before any cell ends: the targets
        for group in groups:
            ran = [cell for cell in group.cells if cell.metrics is not None] or group.cells
            group.paper = paper.lookup(*_trained_model(ran[0]))
    counted = [cell for cell in cells if cell.value is not None]
    return Results(
        grid_dir=grid_dir,
        name=str(grid.get("name", grid_dir.name)),
        metric=metric,
        use=use,
        mode=mode,
        axes=axes,
        seeds=seeds,
        group_axes=group_axes,
        baseline=baseline,
        cells=cells,
        groups=groups,
        figures=figures,
        paper=paper,
        chance=_chance(counted, metric),
        notes=notes,
    )


def seed_label(cell: Cell, seeds: Axis | None) -> str:
    """The cell's label on the seed axis (:data:`SINGLE_RUN` in a grid without one)."""
    return cell.labels[seeds.name] if seeds is not None else SINGLE_RUN


def _groups(cells: list[Cell], seeds: Axis | None, group_axes: list[Axis]) -> list[Group]:
    """The cells grouped by their labels but the seed's, in the grid's order, with each group's summary."""
    groups: dict[tuple[str, ...], Group] = {}
    for cell in cells:
        key = tuple(cell.labels[axis.name] for axis in group_axes)
        group = groups.setdefault(key, Group(key, "/".join(key) or "all", []))
        group.cells.append(cell)
        seed = seed_label(cell, seeds)
        if cell.value is None:
            group.missing[seed] = cell.reason or cell.status
        else:
            group.values[seed] = cell.value
    for group in groups.values():
        group.summary = summarize(list(group.values.values())) if group.values else None
    return list(groups.values())


def _compare(groups: list[Group], group_axes: list[Axis], baseline: Mapping[str, str]) -> None:
    """Each group's baseline group and its differences from it, paired by seed."""
    if not baseline:
        return
    by_key = {group.key: group for group in groups}
    for group in groups:
        key = tuple(baseline.get(axis.name, label) for axis, label in zip(group_axes, group.key))
        if key == group.key:
            group.is_baseline = True
        elif key in by_key:
            group.baseline = by_key[key].name
            group.paired = paired_difference(group.values, by_key[key].values)
