"""The grid files shipped under configs/grids: every cell's command line parses as its ``fit`` would take it, each
setting arrives where the grid says, the ImageNet grids' cells are their models' base configs, and the small
variants are the layouts the docs report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from polyattn_lightning.attention import get_activation
from polyattn_lightning.grids.paper import PAPERS
from polyattn_lightning.grids.spec import REPORT_FIGURES, REPORT_KEYS, REPORT_USES
from polyattn_lightning.grids.spec import settings_args
from training_helpers import CONFIGS, GRIDS, config_piece, grid_cells, parsed_config

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter is intended")

GRID_FILES = sorted(GRIDS.rglob("*.yaml"))
#: the fixture holding a tiny layout of each image data set (conftest.py); other data needs only an existing folder
IMAGE_LAYOUTS = {"ImageFolderDataModule": "image_folder", "TinyImageNetDataModule": "tiny_imagenet"}


def data_root_args(request, base: Path, args: dict[str, Any], tmp_path: Path) -> list[str]:
    """``--data.root`` of a tiny layout for a grid whose data is read from a folder (the user's to place)."""
    data_class = config_piece(base, "data")["class_path"].rsplit(".", 1)[-1]
    if data_class in IMAGE_LAYOUTS:
        return [f"--data.root={request.getfixturevalue(IMAGE_LAYOUTS[data_class])}", "--data.num_workers=0"]
    return [f"--data.root={tmp_path}"] if "data.root" in args else []


def value_at(config, key: str) -> Any:
    for part in key.split("."):
        config = config[part]
    return config


def assert_set(config, key: str, value: Any) -> None:
    """The parsed config holds ``value`` at ``key`` (an attention as the activation it names; a mapping key by key)."""
    parsed = value_at(config, key)
    if key.endswith(".attention"):
        spec = parsed if isinstance(parsed, str) else dict(parsed)
        assert get_activation(spec) == get_activation(value), key
    elif isinstance(value, dict):
        for name, item in value.items():
            assert_set(config, f"{key}.{name}", item)
    else:
        assert (list(parsed) if isinstance(parsed, tuple) else parsed) == value, key


def distinct_runs(cells: list) -> list:
    """The cells that differ in more than their seed (the seed is an int the parser takes like any other)."""
    seen, kept = set(), []
    for name, labels, settings in cells:
        key = repr({k: v for k, v in settings.items() if k != "seed_everything"})
        if key not in seen:
            seen.add(key)
            kept.append((name, labels, settings))
    return kept


@pytest.mark.parametrize("grid", GRID_FILES, ids=lambda p: str(p.relative_to(GRIDS)))
def test_every_cell_parses_with_its_settings(request, tmp_path, monkeypatch, grid: Path):
    """Each cell's ``fit`` command line (base config, the grid's args, the cell's settings) parsed by the CLI and
    pre-checked as ``fit`` does (nothing built), on a tiny layout of the grid's data; each setting is in the
    parsed config where the grid puts it."""
    monkeypatch.chdir(tmp_path)
    base, args, cells = grid_cells(grid)
    assert base.is_file() and base.is_relative_to(CONFIGS)
    fixed = [*settings_args(args), *data_root_args(request, base, args, tmp_path)]
    for name, _, settings in distinct_runs(cells):
        config = parsed_config("--config", str(base), *fixed, *settings_args(settings))
        for key, value in settings.items():
            assert_set(config, key, value)
        assert name and not name.startswith("/") and ".." not in name


@pytest.mark.parametrize("grid", ["imagenet_table2.yaml", "imagenet_families.yaml"])
def test_imagenet_cells_are_their_models_base_configs(image_folder, tmp_path, monkeypatch, grid: str):
    """A model's cell is its base config (classification/imagenet/<model label>.yaml) with the cell's attention:
    the model, trainer and data settings all equal, so the grid runs what each model's config runs (only the run's
    folder, named after the config file, differs: the grid gives each cell its own)."""
    monkeypatch.chdir(tmp_path)
    base, args, cells = grid_cells(GRIDS / grid)
    data = [f"--data.root={image_folder}"]
    for name, labels, settings in distinct_runs(cells):
        attention = settings["model.init_args.attention"]
        cell = parsed_config("--config", str(base), *data, *settings_args(settings))
        own = CONFIGS / "classification" / "imagenet" / f"{labels['model']}.yaml"
        alone = parsed_config("--config", str(own), *data, *settings_args({"model.init_args.attention": attention}))
        for config in (cell, alone):
            config.trainer.logger.init_args.name = None
        for key in ("model", "trainer", "data", "seed_everything"):
            assert cell[key] == alone[key], f"{name}: {key}"


def test_grid_folders_are_distinct():
    """Each grid writes runs/grids/<name>/: no two grid files share a name."""
    names = [yaml.safe_load(path.read_text()).get("name", path.stem) for path in GRID_FILES]
    assert len(names) == len(set(names))


def test_the_small_variants_are_the_documented_layouts():
    """The digits table: 7 attention settings x 3 seeds (the paper's table 1 rows, ReLU and SoftPlus); the
    generated ListOps: softmax, x^3 and x scaled, 3 seeds; the digits figure: 4 lengths x 7 scales."""
    _, _, digits = grid_cells(GRIDS / "digits_table1.yaml")
    attentions = ["softmax", "poly3", "poly3-scaled", "poly1", "poly1-scaled", "relu", "softplus"]
    assert [name for name, _, _ in digits] == [f"{a}/seed{s}" for a in attentions for s in (1, 2, 3)]
    _, _, listops = grid_cells(GRIDS / "listops_generated.yaml")
    assert [name for name, _, _ in listops] == [
        f"{a}/seed{s}" for a in ("softmax", "poly3-scaled", "poly1-scaled") for s in (1, 2, 3)
    ]
    _, _, figure = grid_cells(GRIDS / "digits_figure1.yaml")
    assert {labels["length"] for _, labels, _ in figure} == {"256", "64", "16", "8"} and len(figure) == 28


@pytest.mark.parametrize("grid", GRID_FILES, ids=lambda p: str(p.relative_to(GRIDS)))
def test_report_settings_are_the_reports(grid: Path):
    """The report keys a grid gives are the report's own, its paper table one the report knows, and the seed,
    baseline and figure axes axes of the grid."""
    raw = yaml.safe_load(grid.read_text())
    report = raw["report"]
    assert set(report) <= set(REPORT_KEYS) and report.get("use", "best") in REPORT_USES
    assert report.get("figure", "bars") in REPORT_FIGURES
    assert "paper" not in report or report["paper"] in PAPERS
    axes = raw["axes"]
    assert all(report[key] in axes for key in ("seeds", "x", "lines") if key in report)
    for axis, label in (report.get("baseline") or {}).items():
        assert str(label) in {str(value) for value in axes[axis]["values"]}


def test_imagenet_table_cells_stand_beside_the_papers_numbers():
    """The paper's ImageNet numbers are found for exactly the cells it reports: softmax and x^3 at 1/14 of ViT-S/B,
    Swin-S/B and XCiT-S12 (DeiT's and XCiT-M24's not given, x "performs poorly")."""
    _, _, cells = grid_cells(GRIDS / "imagenet_table2.yaml")
    table = PAPERS["imagenet_top1"]
    found = {
        name
        for name, _, settings in cells
        if table.lookup(settings["model.init_args.model_name"], settings["model.init_args.attention"]) is not None
    }
    models = ("vit_small", "vit_base", "swin_small", "swin_base", "xcit_small_12")
    assert found == {f"{model}/{attention}/seed0" for model in models for attention in ("softmax", "poly3-14")}
