"""The report's figures: PNG files written and readable, and what they draw is the table's numbers (bar heights,
error bars, the scale sweep's lines)."""

from __future__ import annotations

import itertools

import matplotlib.image
import pytest
from matplotlib.container import BarContainer, ErrorbarContainer
from report_grids import metrics, write_grid

from polyattn_lightning.errors import ConfigError
from polyattn_lightning.grids.figures import bars_figure, scale_sweep_figure
from polyattn_lightning.grids.report import write_report
from polyattn_lightning.grids.results import collect

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SEEDS = ("seed_everything", {"seed1": 1, "seed2": 2, "seed3": 3})
LENGTHS = ("model.init_args.model_kwargs", {"256": {"patch_size": 1}, "64": {"patch_size": 2}})
SCALES = ("model.init_args.attention", {str(s): {"name": "poly3", "scale": s} for s in (0.01, 0.1, 1.0)})


def sweep_grid(root, report):
    """Figure 1's layout: 2 lengths x 3 scales x 3 seeds; the middle scale is best, the shorter length better."""
    cells = {
        f"{length}/{scale}/{seed}": metrics(
            0.5 + 0.2 * (scale == "0.1") + 0.05 * (length == "64") + 0.01 * int(seed[-1])
        )
        for length, scale, seed in itertools.product(LENGTHS[1], SCALES[1], SEEDS[1])
    }
    return write_grid(root, {"length": LENGTHS, "scale": SCALES, "seed": SEEDS}, report, cells)


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 5000
    image = matplotlib.image.imread(path)
    assert image.shape[0] > 300 and image.shape[1] > 500
    assert image[..., :3].std() > 0.01  # something is drawn, not a blank page


def test_figure_files_are_written_and_valid(tmp_path):
    root = sweep_grid(tmp_path / "sweep", {"figure": "scale-sweep", "x": "scale", "lines": "length"})
    folder = write_report(root)
    assert sorted(path.name for path in (folder / "figures").iterdir()) == ["bars.png", "scale-sweep.png"]
    for path in (folder / "figures").iterdir():
        assert_png(path)


def test_bars_are_the_means_and_error_bars_the_intervals(tmp_path):
    attention = ("model.init_args.attention", {"softmax": "softmax", "poly3": "poly3"})
    cells = {f"{a}/seed{s}": metrics(0.8 + 0.05 * (a == "poly3") + 0.01 * s) for a in attention[1] for s in (1, 2, 3)}
    cells["poly3/seed2"] = None
    results = collect(write_grid(tmp_path / "g", {"attention": attention, "seed": SEEDS}, {}, cells))
    figure = bars_figure(results)
    bars_axes, differences_axes = figure.axes
    containers = [container for container in bars_axes.containers if isinstance(container, BarContainer)]
    heights = [container.patches[0].get_height() for container in containers]
    assert heights == pytest.approx([group.summary.mean for group in results.groups], abs=1e-12)
    for container, group in zip(containers, results.groups):
        (segment,) = container.errorbar.lines[2][0].get_segments()
        assert [y for _, y in segment] == pytest.approx([group.summary.low, group.summary.high], abs=1e-12)
    (line,) = [line for line in differences_axes.lines if len(line.get_xdata()) == 1 and line.get_marker() == "o"]
    assert line.get_xdata()[0] == pytest.approx(results.groups[1].paired.summary.mean, abs=1e-12)


def test_scale_sweep_draws_a_line_per_length_on_a_log_axis(tmp_path):
    results = collect(sweep_grid(tmp_path / "sweep", {"figure": "scale-sweep"}))  # x, lines: scale, length
    figure = scale_sweep_figure(results, results.figures[1])
    (ax,) = figure.axes
    assert ax.get_xscale() == "log"
    drawn = [container.lines[0] for container in ax.containers if isinstance(container, ErrorbarContainer)]
    assert len(drawn) == 2
    for line, length in zip(drawn, ("256", "64")):
        assert list(line.get_xdata()) == [0.01, 0.1, 1.0]
        expected = [0.5 + 0.2 * (scale == 0.1) + 0.05 * (length == "64") + 0.02 for scale in (0.01, 0.1, 1.0)]
        assert list(line.get_ydata()) == pytest.approx(expected, abs=1e-12)
    assert [label for label in ax.get_legend_handles_labels()[1] if label.startswith("length")] == [
        "length = 256",
        "length = 64",
    ]


def test_scale_sweep_needs_numbers_on_its_x_axis(tmp_path):
    attention = ("model.init_args.attention", {"softmax": "softmax", "poly3": "poly3"})
    cells = {f"{a}/seed{s}": metrics(0.8) for a in attention[1] for s in (1, 2, 3)}
    root = write_grid(
        tmp_path / "g",
        {"attention": attention, "seed": SEEDS},
        {"figure": "scale-sweep", "x": "attention"},
        cells,
    )
    with pytest.raises(ConfigError, match=r"axis 'attention' needs positive numbers \(log axis\); label 'softmax'"):
        write_report(root)
