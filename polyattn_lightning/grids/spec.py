"""A grid file read and checked: the base config, the fixed settings, the axes and their cells.

A grid file (YAML) names a base config (any config ``fit --config`` takes, relative to the grid file) and axes, each a
CLI key with a list of values; the cells are the product of the axes, in their order, except that the axes of a
``zip`` group move together. A cell's name is its labels, joined by ``-`` within a zip group and by ``/`` between
groups (``poly3-scaled/seed1``): its folder under the grid's ``cells/``. Every mistake is one :class:`ConfigError`
line naming the file, the key and what was expected, before anything runs; a CLI key the base config's CLI does not
take is found by parsing the cell's command line with the project's own parser (nothing is built), whose message
names the closest option.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import logging
import re
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..cli import PolyattnCLI, make_cli
from ..cli.runs import FOLDER_LOGGERS
from ..errors import ConfigError, MissingPathError, UserInputError, closest_option
from ..logs import quiet_loggers
from .paper import paper_table

#: The grid file's top-level keys.
TOP_KEYS = ("name", "base", "args", "axes", "zip", "report", "launcher")
#: An axis's keys.
AXIS_KEYS = ("key", "values", "label")
#: The report's settings (``grids.results`` reads them).
REPORT_KEYS = ("metric", "use", "seeds", "baseline", "paper", "figure", "x", "lines")
#: Which value of a cell's metrics.json is its result: the monitored metric's best or last value (``best.value``,
#: ``last.value``), or any metric's last logged value (``metrics[metric]``).
REPORT_USES = ("best", "last", "final")
#: The report's figures: bars always, and with ``figure: scale-sweep`` the sweep too.
REPORT_FIGURES = ("bars", "scale-sweep")
#: The launchers a grid file may hold settings for (``launcher: {slurm: {...}}``).
LAUNCHERS = ("local", "slurm")
#: What a label (one folder name of a cell) may hold.
LABEL = re.compile(r"[\w.=+-]+")


@dataclass(frozen=True)
class Axis:
    """One axis: its name, the CLI key it sets, and its values with their labels (same order)."""

    name: str
    key: str
    labels: tuple[str, ...]
    values: tuple[Any, ...]


@dataclass(frozen=True)
class Cell:
    """One cell: its name (its folder under ``cells/``), its label per axis and the CLI settings of its axes."""

    name: str
    labels: dict[str, str]
    settings: dict[str, Any]


@dataclass
class GridSpec:
    """A checked grid file."""

    path: Path
    name: str
    base: Path
    args: dict[str, Any]
    axes: list[Axis]
    zip: list[list[str]]
    report: dict[str, Any] = field(default_factory=dict)
    launcher: dict[str, Any] = field(default_factory=dict)

    def groups(self) -> list[list[Axis]]:
        """The axes in groups that move together (a zip group, or one axis alone), in the order of the axes."""
        zipped = {name: group for group in self.zip for name in group}
        groups, seen = [], set()
        for axis in self.axes:
            if axis.name in seen:
                continue
            names = zipped.get(axis.name, [axis.name])
            seen.update(names)
            groups.append([a for a in self.axes if a.name in names])
        return groups


def read_grid(path: str | Path) -> GridSpec:
    """Read and check the grid file ``path`` (its shape and values; :func:`check_keys` checks its CLI keys)."""
    path = Path(path)
    if not path.is_file():
        raise MissingPathError(f"grid file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{where}: not valid YAML ({getattr(error, 'problem', error)})") from None
    where = str(path)
    mapping(raw, where, "the grid file")
    known(raw, TOP_KEYS, where, "")
    for key in ("base", "axes"):
        if key not in raw:
            raise ConfigError(f"{where}: no '{key}': a grid file names its base config and its axes")
    name = raw.get("name", path.stem)
    if not isinstance(name, str) or not LABEL.fullmatch(name):
        raise ConfigError(f"{where}: name {name!r}: expected a folder name (letters, digits, . _ = + -)")
    base = path.parent / str(raw["base"])
    if not base.is_file():
        raise MissingPathError(f"{where}: base {raw['base']}: no such config file ({base})")
    args = mapping(raw.get("args") or {}, where, "args")
    axes = [read_axis(axis, value, where) for axis, value in mapping(raw["axes"], where, "axes").items()]
    if not axes:
        raise ConfigError(f"{where}: axes is empty: expected at least one axis (key and values)")
    keys = [axis.key for axis in axes]
    for axis in axes:
        if keys.count(axis.key) > 1:
            raise ConfigError(f"{where}: axes: two axes set {axis.key}; expected one axis per key")
        if axis.key in args:
            raise ConfigError(f"{where}: {axis.key} is set in args and by axes.{axis.name}; expected one of them")
    spec = GridSpec(
        path=path,
        name=name,
        base=base.resolve(),
        args=dict(args),
        axes=axes,
        zip=read_zip(raw.get("zip") or [], axes, where),
        report=read_report(raw.get("report") or {}, axes, where),
        launcher=mapping(raw.get("launcher") or {}, where, "launcher"),
    )
    known(spec.launcher, LAUNCHERS, where, "launcher.")
    cells(spec)  # names checked: two cells of one name are refused here
    return spec


def mapping(value: Any, where: str, what: str) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: {what}: expected a mapping, got {type(value).__name__} {value!r}")
    return value


def known(raw: dict, keys: tuple[str, ...], where: str, prefix: str) -> None:
    """Refuse a key of ``raw`` not in ``keys``, naming the closest one and every valid one."""
    for key in raw:
        if key not in keys:
            closest = closest_option(str(key), keys)
            hint = f" (did you mean {prefix}{closest}?)" if closest else ""
            raise ConfigError(f"{where}: unknown key {prefix}{key}{hint}; expected one of {', '.join(keys)}")


def read_axis(name: Any, raw: Any, where: str) -> Axis:
    """An axis: ``{key, values}`` with values a list (labels ``str(value)``, or ``label`` formatted with each) or a
    mapping label -> value."""
    where_axis = f"{where}: axes.{name}"
    if not isinstance(name, str) or not LABEL.fullmatch(name):
        raise ConfigError(f"{where_axis}: expected an axis name of letters, digits, . _ = + -")
    mapping(raw, where_axis, "the axis")
    known(raw, AXIS_KEYS, where_axis, "")
    key, values = raw.get("key"), raw.get("values")
    if not isinstance(key, str) or not key:
        raise ConfigError(f"{where_axis}: key: expected the CLI key the axis sets, e.g. model.init_args.attention")
    if not values:
        raise ConfigError(f"{where_axis}: values is empty: expected a list of values or a mapping label -> value")
    if isinstance(values, dict):
        if "label" in raw:
            raise ConfigError(f"{where_axis}: label formats a list's values; the mapping's keys are the labels")
        labels, values = [str(label) for label in values], list(values.values())
    elif isinstance(values, list):
        form = raw.get("label", "{}")
        for index, value in enumerate(values):
            if isinstance(value, (dict, list)):
                raise ConfigError(
                    f"{where_axis}: values[{index}] is a {type(value).__name__}: give the values as a mapping "
                    "label -> value, so that its cells have readable names"
                )
        try:
            labels = [form.format(value) for value in values]
        except (IndexError, KeyError, ValueError, AttributeError) as error:
            raise ConfigError(f"{where_axis}: label {form!r}: expected a format with one {{}} ({error})") from None
    else:
        raise ConfigError(f"{where_axis}: values: expected a list or a mapping label -> value, got {values!r}")
    for label in labels:
        if not LABEL.fullmatch(label) or label.startswith("."):
            raise ConfigError(
                f"{where_axis}: label {label!r}: expected letters, digits and . _ = + - (it names a folder)"
            )
    return Axis(name=name, key=key, labels=tuple(labels), values=tuple(values))


def read_zip(raw: Any, axes: list[Axis], where: str) -> list[list[str]]:
    """The zip groups: lists of axis names of equal length, each axis in one group at most."""
    if not isinstance(raw, list) or not all(isinstance(group, list) for group in raw):
        raise ConfigError(f"{where}: zip: expected a list of lists of axis names, e.g. [[attention, lr]]")
    by_name, grouped = {axis.name: axis for axis in axes}, set()
    for group in raw:
        for name in group:
            if name not in by_name:
                closest = closest_option(str(name), by_name)
                hint = f" (did you mean {closest}?)" if closest else ""
                raise ConfigError(f"{where}: zip: no axis {name}{hint}; the axes: {', '.join(by_name)}")
            if name in grouped:
                raise ConfigError(f"{where}: zip: axis {name} is in two groups; expected one group per axis")
            grouped.add(name)
        lengths = {name: len(by_name[name].values) for name in group}
        if len(set(lengths.values())) > 1:
            counts = ", ".join(f"{name} has {n}" for name, n in lengths.items())
            raise ConfigError(f"{where}: zip {group}: axes that move together need as many values each ({counts})")
    return [list(group) for group in raw]


def read_report(raw: Any, axes: list[Axis], where: str) -> dict[str, Any]:
    """The report's settings, checked: its keys and choices, the seed axis among the axes, the baseline and the
    scale sweep's axes among the others (a seed is no group), the paper table. ``grids.results`` checks a grid
    folder's ``grid.json`` with it too, so that a hand-edited one gets the same one-line errors."""
    mapping(raw, where, "report")
    unknown = [key for key in raw if key not in REPORT_KEYS]
    if unknown:
        closest = closest_option(str(unknown[0]), REPORT_KEYS)
        hint = f" (did you mean {closest!r}?)" if closest else ""
        raise ConfigError(f"{where}: unknown report key {unknown[0]!r}{hint}; report keys: {', '.join(REPORT_KEYS)}")
    if raw.get("use", "best") not in REPORT_USES:
        raise ConfigError(f"{where}: report.use must be one of {', '.join(REPORT_USES)}, got {raw['use']!r}")
    seeds = seed_axis(raw, axes, where)
    group_axes = [axis for axis in axes if axis is not seeds]
    baseline = raw.get("baseline")
    if baseline is not None and (not isinstance(baseline, dict) or not baseline):
        raise ConfigError(
            f"{where}: report.baseline must map axes to labels, e.g. {{attention: softmax}}, got {baseline!r}"
        )
    for name, label in (baseline or {}).items():
        axis = report_axis(group_axes, name, "baseline", where)
        if str(label) not in axis.labels:
            raise ConfigError(
                f"{where}: report.baseline: {label!r} is not a label of axis {name!r}; labels: {', '.join(axis.labels)}"
            )
    figure = raw.get("figure", "bars")
    if figure not in REPORT_FIGURES:
        raise ConfigError(f"{where}: report.figure must be one of {', '.join(REPORT_FIGURES)}, got {figure!r}")
    if figure == "bars":
        given = [key for key in ("x", "lines") if raw.get(key)]
        if given:
            raise ConfigError(f"{where}: report.{given[0]} names an axis of figure: scale-sweep; figure is bars")
    else:
        sweep_axes(raw, group_axes, where)
    if raw.get("paper"):
        paper_table(raw["paper"], f"{where}: report.paper")
    return dict(raw)


def report_axis(axes: list[Axis], name: Any, setting: str, where: str) -> Axis:
    """The axis called ``name`` that ``report.<setting>`` names, or an error naming the closest one."""
    for axis in axes:
        if axis.name == name:
            return axis
    closest = closest_option(str(name), [axis.name for axis in axes])
    hint = f" (did you mean {closest!r}?)" if closest else ""
    raise ConfigError(
        f"{where}: report.{setting}: {name!r} is not an axis{hint}; axes: {', '.join(a.name for a in axes)}"
    )


def seed_axis(report: dict[str, Any], axes: list[Axis], where: str) -> Axis | None:
    """The axis the report's statistics repeat over: ``report.seeds``, else the axis named ``seed``, else the one
    setting ``seed_everything``, else none (each cell is its own group)."""
    if report.get("seeds"):
        return report_axis(axes, report["seeds"], "seeds", where)
    return next((axis for axis in axes if axis.name == "seed" or axis.key == "seed_everything"), None)


def sweep_axes(report: dict[str, Any], group_axes: list[Axis], where: str) -> tuple[str, str | None]:
    """The scale sweep's x axis (``report.x``, else the axis named ``scale``) and the axis with a line per label
    (``report.lines``, else the axis named ``length`` if there is one, else one line), among ``group_axes``."""
    x = report_axis(group_axes, report.get("x") or "scale", "x", where).name
    lines = report.get("lines") or ("length" if any(axis.name == "length" for axis in group_axes) else None)
    return x, report_axis(group_axes, lines, "lines", where).name if lines else None


def cells(spec: GridSpec) -> list[Cell]:
    """The grid's cells: the product of its groups of axes, in order; two cells of one name are refused."""
    groups = spec.groups()
    found: dict[str, Cell] = {}
    for indices in itertools.product(*(range(len(group[0].values)) for group in groups)):
        picked = [(axis, index) for group, index in zip(groups, indices) for axis in group]
        name = "/".join("-".join(axis.labels[index] for axis in group) for group, index in zip(groups, indices))
        if name in found:
            raise ConfigError(f"{spec.path}: two cells are named {name}; expected distinct labels")
        found[name] = Cell(
            name=name,
            labels={axis.name: axis.labels[index] for axis, index in picked},
            settings={axis.key: axis.values[index] for axis, index in picked},
        )
    return list(found.values())


def cli_value(value: Any) -> str:
    """A setting as the command line gives it: a string as it is, anything else as JSON (``true``, ``{...}``)."""
    return value if isinstance(value, str) else json.dumps(value)


def settings_args(settings: dict[str, Any]) -> list[str]:
    return [f"--{key}={cli_value(value)}" for key, value in settings.items()]


def cell_command(spec: GridSpec, cell: Cell, cell_dir: Path) -> list[str]:
    """The command line that trains ``cell`` alone in ``cell_dir``: ``python -m polyattn_lightning fit`` of the base
    config with the grid's args, the cell's settings and its logger (TensorBoard) writing in ``cell_dir``."""
    cell_dir = Path(cell_dir).absolute()
    return [
        sys.executable,
        "-m",
        "polyattn_lightning",
        "fit",
        "--config",
        str(spec.base),
        *settings_args(spec.args),
        *settings_args(cell.settings),
        f"--trainer.logger.init_args.save_dir={cell_dir.parent}",
        "--trainer.logger.init_args.name=",
        f"--trainer.logger.init_args.version={cell_dir.name}",
        f"--trainer.default_root_dir={cell_dir}",  # where a SLURM requeue checkpoint goes
    ]


class _ParseOnly(PolyattnCLI):
    """The CLI up to its checks before any model is built: parsed, the project's pre-checks run, nothing built."""

    def instantiate_classes(self) -> None:
        pass


def parsed(argv: list[str], where: str):
    """The config the CLI parses from ``argv`` (``--config BASE ...``), or a :class:`ConfigError` with the CLI's
    one-line message after ``where``."""
    stderr = io.StringIO()
    try:
        with (
            contextlib.redirect_stderr(stderr),
            quiet_loggers("lightning.pytorch", "lightning.fabric", level=logging.WARNING),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore")
            return make_cli(argv, run=False, cli_class=_ParseOnly).config
    except SystemExit:
        text = stderr.getvalue().split("error: ", 1)[-1]
        lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("(`")]
        raise ConfigError(f"{where}: {' '.join(lines)}") from None
    except UserInputError as error:
        raise ConfigError(f"{where}: {error}") from None


def check_keys(spec: GridSpec) -> None:
    """Parse the base config with the grid's args, then with each value of each axis, as the cells' ``fit`` will
    (nothing is built): a key the CLI does not take or a value it refuses is one :class:`ConfigError` naming the
    grid file, the axis (or ``args``) and the CLI's own message (the closest option). The base config's logger must
    write in a folder a resumed run goes on in (TensorBoard)."""
    base = ["--config", str(spec.base), *settings_args(spec.args)]
    config = parsed(base, f"{spec.path}: args" if spec.args else f"{spec.path}: base {spec.base}")
    logger = config.trainer.get("logger")
    if not str(getattr(logger, "class_path", "")).endswith(FOLDER_LOGGERS):
        raise ConfigError(
            f"{spec.path}: base {spec.base}: trainer.logger is {getattr(logger, 'class_path', logger)!r}; a grid "
            "cell's run folder is its TensorBoardLogger's (resumed runs go on in it): expected that logger"
        )
    for axis in spec.axes:
        for label, value in zip(axis.labels, axis.values):
            parsed([*base, *settings_args({axis.key: value})], f"{spec.path}: axes.{axis.name} {label}")
