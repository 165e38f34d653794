"""A grid report's figures (matplotlib, no GUI backend): bars per group, and the paper's figure-1 scale sweep.

* ``bars.png``: each group's mean with its 95% t interval as the error bar and every seed's value as a dot (the
  paper's number as a red cross where there is one), ``n`` written at the foot of each bar; beside it, when the
  grid has a baseline, each group's difference from its baseline paired by seed, with its interval, against zero.
  Groups that differ only on the baseline's axis stand side by side in one cluster, coloured by that axis's label.
* ``scale-sweep.png``: the metric against the scale (log axis), one line per sequence length (and per any other
  label), error bars over seeds, each line's best scale starred.

A group with one seed is drawn without an error bar; a group without a finished seed is left out of the drawing
(the tables list it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

from matplotlib.figure import Figure  # pyplot-free: no GUI backend, nothing kept alive after saving

from ..errors import ConfigError
from .folder import GRID_JSON
from .results import FigureSpec, Group, Results

BASELINE_COLOUR = "0.55"


def _label(results: Results) -> str:
    return f"{results.metric} ({results.use})" if results.metric else "metric"


def _half_width(group: Group) -> float:
    return group.summary.half_width if group.summary and group.summary.half_width is not None else 0.0


def _clusters(results: Results) -> tuple[list[tuple[str, list[Group]]], int | None, list[str]]:
    """Groups in clusters that differ only on the baseline's (first) axis; that axis's position and labels, which
    colour the bars (None and none for a grid of one axis or without a baseline)."""
    colour_axis = next((axis for axis in results.group_axes if axis.name in results.baseline), None)
    if colour_axis is None or len(results.group_axes) == 1:
        return [(group.name, [group]) for group in results.groups], None, []
    position = results.group_axes.index(colour_axis)
    clusters: dict[str, list[Group]] = {}
    for group in results.groups:
        rest = group.key[:position] + group.key[position + 1 :]
        clusters.setdefault("/".join(rest), []).append(group)
    return list(clusters.items()), position, list(colour_axis.labels)


def _draw_group(ax, x: float, width: float, group: Group, colour: str, label: str | None) -> None:
    """One group at ``x``: its bar (the mean, the 95% interval as error bar), its seeds as dots, ``n`` at the foot,
    the paper's number as a red cross."""
    if group.summary is not None:
        error = _half_width(group) or None
        ax.bar(x, group.summary.mean, width, color=colour, alpha=0.75, label=label, yerr=error, capsize=4)
        ax.plot([x] * len(group.values), list(group.values.values()), "o", color="black", markersize=3)
    ax.annotate(f"n={len(group.values)}", (x, 0.01), xycoords=("data", "axes fraction"), ha="center", fontsize=7)
    if group.paper is not None:
        ax.plot(x, group.paper.value, "x", color="red", markersize=9, markeredgewidth=2, label="paper")


def bars_figure(results: Results) -> Figure:
    """The groups' means with 95% intervals and seeds, and (with a baseline) the paired differences beside them."""
    clusters, colour_position, colour_labels = _clusters(results)
    compared = [group for group in results.groups if group.paired is not None and group.paired.summary is not None]
    width = max(6.0, 0.55 * len(results.groups) + 2.5)
    fig = Figure(figsize=(width + (5.0 if compared else 0.0), 4.8), layout="constrained")
    axes = fig.subplots(1, 2 if compared else 1, squeeze=False, width_ratios=[width, 5.0] if compared else None)[0]
    ax = axes[0]
    colours = {label: f"C{i}" for i, label in enumerate(colour_labels)}
    bar_width = 0.8 / max(1, len(colour_labels))
    for position, (_, members) in enumerate(clusters):
        for slot, group in enumerate(members):
            label = None if colour_position is None else group.key[colour_position]
            colour = colours.get(label, BASELINE_COLOUR if group.is_baseline else "C0")
            x = position + (slot - (len(members) - 1) / 2) * bar_width
            _draw_group(ax, x, bar_width * 0.9, group, colour, label)
    if results.chance is not None:
        ax.axhline(results.chance, color="0.3", linestyle="--", linewidth=1, label="chance")
    tilted = len(clusters) > 6
    ax.set_xticks(range(len(clusters)), [name for name, _ in clusters], rotation=30 if tilted else 0,
                  ha="right" if tilted else "center")  # fmt: skip
    ax.set_ylabel(_label(results))
    ax.set_title(f"{results.name}: mean, 95% t interval over seeds, seeds as dots", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    handles = dict(zip(*ax.get_legend_handles_labels()[::-1]))  # one entry per label
    if handles:
        ax.legend(handles.values(), handles.keys(), fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if compared:
        _differences(axes[1], compared, results)
    return fig


def _differences(ax, compared: list[Group], results: Results) -> None:
    """Paired differences from the baseline with their intervals (a dot without a bar for one pair)."""
    rows = list(range(len(compared)))[::-1]
    for row, group in zip(rows, compared):
        summary = group.paired.summary
        ax.errorbar(summary.mean, row, xerr=summary.half_width, fmt="o", color="C3", capsize=4)
        ax.annotate(
            f"n={summary.n}", (summary.mean, row), xytext=(0, 6), textcoords="offset points", ha="center", fontsize=7
        )
    ax.axvline(0.0, color="0.3", linewidth=1)
    ax.set_ylim(-0.7, len(compared) - 0.3)
    ax.set_yticks(rows, [f"{group.name} - {group.baseline}" for group in compared], fontsize=8)
    ax.set_xlabel(f"difference in {_label(results)}")
    ax.set_title("paired by seed, 95% t interval", fontsize=9)
    ax.grid(True, axis="x", alpha=0.3)


def _number(group: Group, results: Results, axis_name: str) -> float:
    """The numeric value of ``axis_name`` in ``group``: its setting, the setting's ``scale``, or its label."""
    axis = next(axis for axis in results.group_axes if axis.name == axis_name)
    label = group.key[results.group_axes.index(axis)]
    value = group.cells[0].settings.get(axis.key)
    if isinstance(value, Mapping):
        value = value.get("scale")
    for candidate in (value, label):
        try:
            number = float(candidate)
        except (TypeError, ValueError):
            continue
        if number > 0 and math.isfinite(number):
            return number
    raise ConfigError(
        f"{results.grid_dir / GRID_JSON}: report.figure scale-sweep: axis {axis_name!r} needs positive numbers "
        f"(log axis); label {label!r} is set to {group.cells[0].settings.get(axis.key)!r}"
    )


def scale_sweep_figure(results: Results, spec: FigureSpec) -> Figure:
    """The metric against ``spec.x`` (log axis), one line per ``spec.lines`` label (and other labels), 95% bars."""
    names = [axis.name for axis in results.group_axes]
    x_index = names.index(spec.x)
    order = sorted(range(len(names)), key=lambda i: names[i] != spec.lines)  # the lines axis first in the legend
    lines: dict[str, list[tuple[float, Group]]] = {}
    for group in results.groups:
        if group.summary is None:
            continue
        legend = ", ".join(f"{names[i]} = {group.key[i]}" for i in order if i != x_index)
        lines.setdefault(legend, []).append((_number(group, results, spec.x), group))
    fig = Figure(figsize=(7.5, 5.0), layout="constrained")
    ax = fig.subplots()
    maximise = results.mode != "min"
    for legend, points in lines.items():
        points.sort(key=lambda point: point[0])
        xs = [x for x, _ in points]
        means = [group.summary.mean for _, group in points]
        drawn = ax.errorbar(
            xs,
            means,
            yerr=[_half_width(group) for _, group in points],
            marker="o",
            capsize=3,
            label=legend or results.name,
        )
        best = (max if maximise else min)(range(len(means)), key=means.__getitem__)
        ax.plot(xs[best], means[best], marker="*", markersize=14, color=drawn.lines[0].get_color())
    if results.chance is not None:
        ax.axhline(results.chance, color="0.3", linestyle="--", linewidth=1, label="chance")
    ax.set_xscale("log")
    ax.set_xlabel(spec.x)
    ax.set_ylabel(_label(results))
    ax.set_title(f"{results.name}: mean and 95% t interval over seeds; best {spec.x} of each line starred", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def draw_figures(results: Results, folder: Path) -> list[Path]:
    """Every figure the grid's report settings ask for, as PNGs in ``folder``; the paths written."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for spec in results.figures:
        fig = bars_figure(results) if spec.kind == "bars" else scale_sweep_figure(results, spec)
        path = folder / f"{spec.kind}.png"
        fig.savefig(path, dpi=120)
        written.append(path)
    return written
