"""``polyattn norms RUN_DIR [RUN_DIR ...] [--layer 2 --layer 12] [--quantity phi_norm ...] --out norms.png``

Draws the polynomial-attention paper's norm figure from runs that logged
:class:`~polyattn_lightning.callbacks.AttentionNorms`: each norm (averaged over
heads) against the training step, one line per run, one panel per layer (a row
per quantity). A RUN_DIR is a run's log directory or any folder above runs:
every directory below it holding TensorBoard event files (read with
tensorboard's ``EventAccumulator``) or a CSVLogger ``metrics.csv`` is one run,
labelled by its path and the attention activation of its ``config.yaml`` or
``hparams.yaml``.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

import yaml
from matplotlib.figure import Figure

from ..attention import describe, get_activation
from ..diagnostics.norms import QUANTITIES
from ..errors import ArgumentParser, ConfigError, MissingPathError

#: ``attention/<quantity>/layer<NN>/mean``: the head averages the figure draws.
MEAN_KEY = re.compile(r"^attention/(?P<quantity>\w+)/layer(?P<layer>\d+)/mean$")
AXIS_LABELS = {
    "phi_norm": r"$\|\phi(S)\|_F$",
    "jacobian_norm": r"$\|\partial\phi(S)/\partial S\|_F$",
    "output_norm": r"$\|\phi(S)\,V\|_F$",
}

Series = dict[tuple[str, int], list[tuple[int, float]]]  # (quantity, layer) -> [(step, value)]


class _PlainLoader(yaml.SafeLoader):
    """Reads Lightning's ``hparams.yaml`` safely: its ``!!python/object`` values become plain mappings."""


_PlainLoader.add_multi_constructor(
    "tag:yaml.org,2002:python/",
    lambda loader, suffix, node: loader.construct_mapping(node) if isinstance(node, yaml.MappingNode) else None,
)


def find_runs(roots: list[Path]) -> list[Path]:
    """Directories below ``roots`` (or the roots) holding TensorBoard event files or a ``metrics.csv``."""
    runs = []
    for root in roots:
        if not root.is_dir():
            raise MissingPathError(f"run directory {root} does not exist")
        found = {p.parent for p in root.rglob("events.out.tfevents.*")} | {p.parent for p in root.rglob("metrics.csv")}
        if not found:
            raise MissingPathError(f"{root} holds no TensorBoard event files and no metrics.csv")
        runs += sorted(found)
    return runs


def read_norms(run: Path) -> Series:
    """The head-averaged norms a run logged, by (quantity, layer)."""
    series: Series = {}
    if any(run.glob("events.out.tfevents.*")):
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(run), size_guidance={"scalars": 0})  # 0: keep every point
        events.Reload()
        for tag in events.Tags()["scalars"]:
            if match := MEAN_KEY.match(tag):
                key = (match["quantity"], int(match["layer"]))
                series[key] = [(e.step, e.value) for e in events.Scalars(tag)]
    metrics = run / "metrics.csv"
    if metrics.is_file():
        with metrics.open(newline="") as file:
            for row in csv.DictReader(file):
                for column, value in row.items():
                    if value and (match := MEAN_KEY.match(column)):
                        key = (match["quantity"], int(match["layer"]))
                        series.setdefault(key, []).append((int(row["step"]), float(value)))
    return {key: sorted(points) for key, points in series.items()}


def run_label(run: Path, root: Path) -> str:
    """``<path below the root> (<activation>)``; the activation comes from the run's saved config or hparams."""
    name = str(run.relative_to(root.parent)) if run != root else run.name
    for file, keys in (("config.yaml", ("model", "init_args", "attention")), ("hparams.yaml", ("attention",))):
        path = run / file
        if not path.is_file():
            continue
        node = yaml.load(path.read_text(), Loader=_PlainLoader) or {}
        for key in keys:
            node = node.get(key) if isinstance(node, dict) else None
        if node is not None:
            try:
                return f"{name} ({describe(get_activation(node))})"
            except (ValueError, TypeError, KeyError):
                return f"{name} ({node})"
    return name


def norms_figure(runs: dict[str, Series], layers: list[int] | None, quantities: list[str], log: bool) -> Figure:
    """A row per quantity, a panel per layer, a line per run."""
    available = sorted({layer for series in runs.values() for (_, layer) in series})
    layers = layers or available
    missing = sorted(set(layers) - set(available))
    if missing:
        raise ConfigError(f"no run logged layer(s) {missing}; logged layers: {available}")
    fig = Figure(figsize=(max(4.2 * len(layers), 7.0), 3.3 * len(quantities) + 0.8), layout="constrained")
    axes = fig.subplots(len(quantities), len(layers), squeeze=False)
    for row, quantity in zip(axes, quantities):
        for ax, layer in zip(row, layers):
            for label, series in runs.items():
                points = series.get((quantity, layer))
                if points:
                    steps, values = zip(*points)
                    ax.plot(steps, values, marker="." if len(points) < 30 else None, label=label)
            ax.set_title(f"layer {layer}", fontsize=10)
            ax.set_xlabel("training step")
            ax.set_ylabel(f"{AXIS_LABELS.get(quantity, quantity)} (mean over heads)")
            if log:
                ax.set_yscale("log")
            ax.grid(True, alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    per_row = int(fig.get_figwidth() * 14) // (max(map(len, labels), default=1) + 6)  # ~14 characters per inch at 8 pt
    fig.legend(handles, labels, loc="outside lower center", ncols=max(1, min(len(labels), per_row)), fontsize=8)
    fig.suptitle("Attention norms during training (probe batch)")
    return fig


def parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="polyattn norms",
        description=(
            "Draw the attention norms runs logged (TensorBoard or CSV) against the training step: a line per run, "
            "a panel per layer, a row per norm."
        ),
    )
    p.add_argument("runs", type=Path, nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", type=Path, required=True, help="PNG file to write")
    p.add_argument(
        "--layer", type=int, action="append", help="1-based layer to draw (repeat); default: every logged one"
    )
    p.add_argument(
        "--quantity",
        choices=list(QUANTITIES.values()),
        action="append",
        help="norm to draw (repeat); default: all three",
    )
    p.add_argument("--linear", action="store_true", help="linear instead of log y axis")
    p.add_argument("--dpi", type=int, default=100)
    return p


def main(argv: list[str] | None = None) -> Path:
    args = parser().parse_args(argv)
    runs: dict[str, Series] = {}
    skipped: list[str] = []
    for root in args.runs:
        for run in find_runs([root]):
            series = read_norms(run)
            if series:
                runs[run_label(run, root)] = series
            else:
                skipped.append(str(run.relative_to(root.parent)) if run != root else str(run))
    if skipped:  # one line: every evaluation of a checkpoint (validate_last/...) has logs and no norms
        print(
            f"skipped {len(skipped)} folder{'s' * (len(skipped) != 1)} whose logs hold no attention norms "
            f"(evaluations of a checkpoint, runs with --callbacks_off [norms] or stopped before the first probe "
            f"step): {', '.join(skipped)}"
        )
    if not runs:
        raise ConfigError(
            f"no attention norms logged under {', '.join(map(str, args.runs))}: the standard norms "
            "callback logs them (every --norms.every_n_steps steps) unless --callbacks_off names it"
        )
    fig = norms_figure(runs, args.layer, args.quantity or list(QUANTITIES.values()), log=not args.linear)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=args.dpi)
    print(f"wrote {args.out} ({len(runs)} run{'s' * (len(runs) != 1)})")
    return args.out
