"""A grid folder's results: every cell's value of the report's metric, the cells grouped over seeds, and their
statistics (what :mod:`.report` writes as tables and :mod:`.figures` draws).

Read from the folder alone: ``grid.json`` (the axes, the cells, the grid file's ``report:`` settings) and each cell's
``metrics.json`` (written by the fit itself; no log is scraped). Only cells whose ``metrics.json`` says
``"status": "finished"`` count; every other cell (not started, interrupted, failed, finished without the metric) is
listed with the reason, so a missing seed is never silent.

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
from .paper import PaperTable, PaperValue, paper_table
from .stats import Paired, Summary, paired_difference, summarize

GRID_FILE = "grid.json"
METRICS_FILE = "metrics.json"
CELL_FILE = "cell.json"
#: Which value of a cell's metrics.json is its result: the monitored metric's best or last value (``best.value``,
#: ``last.value``), or any metric's last logged value (``metrics[metric]``).
USES = ("best", "last", "final")
FIGURES = ("bars", "scale-sweep")
#: The ``report:`` keys of a grid file this module reads.
REPORT_KEYS = ("metric", "use", "seeds", "baseline", "paper", "figure", "x", "lines")
#: The seed label of a cell in a grid without a seed axis (each group is one run).
SINGLE_RUN = "run"
#: The label a baseline defaults to when ``report.baseline`` is not set.
DEFAULT_BASELINE = "softmax"


@dataclass(frozen=True)
class Axis:
    name: str
    key: str
    labels: tuple[str, ...]


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


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise DataError(f"{path}: cannot read the {what}: {error}") from None


def _axis(axes: list[Axis], name: str, setting: str, grid_file: Path) -> Axis:
    for axis in axes:
        if axis.name == name:
            return axis
    closest = closest_option(str(name), [axis.name for axis in axes])
    hint = f" (did you mean {closest!r}?)" if closest else ""
    raise ConfigError(
        f"{grid_file}: report.{setting}: {name!r} is not an axis{hint}; axes: {', '.join(a.name for a in axes)}"
    )


def _settings(report: Mapping[str, Any], grid_file: Path) -> dict[str, Any]:
    unknown = [key for key in report if key not in REPORT_KEYS]
    if unknown:
        closest = closest_option(unknown[0], REPORT_KEYS)
        hint = f" (did you mean {closest!r}?)" if closest else ""
        raise ConfigError(
            f"{grid_file}: unknown report key {unknown[0]!r}{hint}; report keys: {', '.join(REPORT_KEYS)}"
        )
    use = report.get("use", "best")
    if use not in USES:
        raise ConfigError(f"{grid_file}: report.use must be one of {', '.join(USES)}, got {use!r}")
    return dict(report)


def _figures(report: Mapping[str, Any], group_axes: list[Axis], grid_file: Path) -> list[FigureSpec]:
    """Bars always; with ``figure: scale-sweep`` also the sweep over the axes ``report.x`` and ``report.lines``
    (by default the axes named ``scale`` and ``length``; both axes other than the seed's)."""
    figure = report.get("figure", "bars")
    if figure not in FIGURES:
        raise ConfigError(f"{grid_file}: report.figure must be one of {', '.join(FIGURES)}, got {figure!r}")
    if figure == "bars":
        given = [key for key in ("x", "lines") if report.get(key)]
        if given:
            raise ConfigError(f"{grid_file}: report.{given[0]} names an axis of figure: scale-sweep; figure is bars")
        return [FigureSpec("bars")]
    x = _axis(group_axes, report.get("x") or "scale", "x", grid_file).name
    lines = report.get("lines") or ("length" if any(axis.name == "length" for axis in group_axes) else None)
    lines = _axis(group_axes, lines, "lines", grid_file).name if lines else None
    return [FigureSpec("bars"), FigureSpec("scale-sweep", x, lines)]


def _seeds_axis(report: Mapping[str, Any], axes: list[Axis], grid_file: Path, notes: list[str]) -> Axis | None:
    """``report.seeds``, else the axis named ``seed``, else the one setting ``seed_everything``, else none."""
    if report.get("seeds"):
        return _axis(axes, report["seeds"], "seeds", grid_file)
    for axis in axes:
        if axis.name == "seed" or axis.key == "seed_everything":
            notes.append(f"Seeds: the axis {axis.name!r} (report.seeds not set; it sets {axis.key}).")
            return axis
    notes.append(
        "Seeds: no seed axis (report.seeds not set, no axis sets seed_everything): each cell is its own group."
    )
    return None


def _baseline(report: Mapping[str, Any], group_axes: list[Axis], grid_file: Path, notes: list[str]) -> dict[str, str]:
    """``report.baseline`` checked against the axes; unset, the first axis with a ``softmax`` label (said in notes)."""
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
    if not isinstance(baseline, Mapping) or not baseline:
        raise ConfigError(
            f"{grid_file}: report.baseline must map axes to labels, e.g. {{attention: softmax}}, got {baseline!r}"
        )
    for name, label in baseline.items():
        axis = _axis(group_axes, name, "baseline", grid_file)
        if str(label) not in axis.labels:
            raise ConfigError(
                f"{grid_file}: report.baseline: {label!r} is not a label of axis {name!r}; "
                f"labels: {', '.join(axis.labels)}"
            )
    return {name: str(label) for name, label in baseline.items()}


def _state(folder: Path) -> tuple[str, str, dict[str, Any] | None]:
    """A cell's state, why it does not count (empty when it finished) and its metrics.json: only a metrics.json
    that says ``finished`` counts; a cell with attempts and no metrics.json is still running or was stopped before
    its fit could write one."""
    metrics_file = folder / METRICS_FILE
    if not metrics_file.is_file():
        cell_file = folder / CELL_FILE
        attempts = (_read_json(cell_file, "cell file") if cell_file.is_file() else {}).get("attempts", 0)
        if not attempts:
            return "not started", "not started (no metrics.json)", None
        return (
            "not finished",
            (
                f"not finished: no metrics.json after {attempts} attempt(s) (still running, or stopped before it could "
                "write one)"
            ),
            None,
        )
    try:
        metrics = json.loads(metrics_file.read_text())
    except (OSError, ValueError) as error:
        return "unreadable", f"metrics.json unreadable: {error}", None
    status = str(metrics.get("status"))
    if status == "failed":
        return status, f"failed: {metrics.get('error') or 'no error recorded'}", metrics
    if status != "finished":
        return status, f"{status} (metrics.json status {status!r}): not finished", metrics
    return status, "", metrics


def _read_cell(grid_dir: Path, entry: Mapping[str, Any]) -> Cell:
    """The cell as grid.json lists it, with its state; a cell that does not count names its log where it has one."""
    folder = grid_dir / entry["dir"]
    status, reason, metrics = _state(folder)
    log = folder / "cell.log"
    if reason and log.is_file():
        reason += f"; log: {log.relative_to(grid_dir)}"
    settings = dict(entry.get("settings") or {})
    return Cell(entry["name"], dict(entry["labels"]), settings, folder, status, metrics, reason=reason or None)


def _metric(report: Mapping[str, Any], cells: list[Cell], grid_file: Path) -> tuple[str | None, str | None]:
    """The report's metric (``report.metric``, else the cells' monitored metric) and its mode (max/min)."""
    finished = [cell for cell in cells if cell.status == "finished"]
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
    if cell.status != "finished":
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
    grid_file = grid_dir / GRID_FILE
    if not grid_file.is_file():
        raise MissingPathError(
            f"{grid_dir}: no {GRID_FILE} here; a grid's folder (as `polyattn grid GRID.yaml` "
            f"writes it) holds {GRID_FILE} and cells/"
        )
    grid = _read_json(grid_file, "grid file")
    if grid.get("schema") != 1:
        raise DataError(f"{grid_file}: schema {grid.get('schema')!r}; this version reads schema 1")
    report = _settings(grid.get("report") or {}, grid_file)
    axes = [Axis(a["name"], a["key"], tuple(str(label) for label in a["labels"])) for a in grid["axes"]]
    notes: list[str] = []
    seeds = _seeds_axis(report, axes, grid_file, notes)
    group_axes = [axis for axis in axes if axis is not seeds]
    baseline = _baseline(report, group_axes, grid_file, notes)
    figures = _figures(report, group_axes, grid_file)
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
