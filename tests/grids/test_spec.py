"""Grid files read into cells: the product, zip groups, readable names, and every mistake one line naming the file,
the key and what was expected, from Python (``ConfigError``) and from the command line (exit status 2)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml
from training_helpers import QUICKSTART

from polyattn_lightning import cli
from polyattn_lightning.errors import ConfigError, MissingPathError
from polyattn_lightning.grids.spec import cell_command, cells, check_keys, read_grid

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter is intended")

ATTENTION = {
    "key": "model.init_args.attention",
    "values": {"softmax": "softmax", "poly3": "poly3", "poly3-scaled": {"name": "poly3", "scale": "inv_sqrt_n"}},
}
SEED = {"key": "seed_everything", "values": [1, 2], "label": "seed{}"}


def grid_file(tmp_path: Path, **content) -> Path:
    """A grid file on the digits quickstart (base given relative to the grid file), with ``content`` over it."""
    folder = tmp_path / "grids"
    folder.mkdir(exist_ok=True)
    data = {"name": "digits", "base": os.path.relpath(QUICKSTART, folder), **content}
    path = folder / "grid.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in data.items() if v is not None}, sort_keys=False))
    return path


def test_cells_are_the_product_of_the_axes_in_order_with_readable_names(tmp_path):
    spec = read_grid(grid_file(tmp_path, axes={"attention": ATTENTION, "seed": SEED}))
    assert spec.base == QUICKSTART.resolve()
    assert [cell.name for cell in cells(spec)] == [
        "softmax/seed1",
        "softmax/seed2",
        "poly3/seed1",
        "poly3/seed2",
        "poly3-scaled/seed1",
        "poly3-scaled/seed2",
    ]
    cell = cells(spec)[5]
    assert cell.labels == {"attention": "poly3-scaled", "seed": "seed2"}
    assert cell.settings == {
        "model.init_args.attention": {"name": "poly3", "scale": "inv_sqrt_n"},
        "seed_everything": 2,
    }


def test_zipped_axes_move_together_and_share_a_name_part(tmp_path):
    lr = {"key": "model.init_args.optim.lr", "values": [0.1, 0.2, 0.3], "label": "lr{}"}
    spec = read_grid(
        grid_file(tmp_path, axes={"attention": ATTENTION, "seed": SEED, "lr": lr}, zip=[["attention", "lr"]])
    )
    names = [cell.name for cell in cells(spec)]
    assert names == [
        "softmax-lr0.1/seed1",
        "softmax-lr0.1/seed2",
        "poly3-lr0.2/seed1",
        "poly3-lr0.2/seed2",
        "poly3-scaled-lr0.3/seed1",
        "poly3-scaled-lr0.3/seed2",
    ]
    assert cells(spec)[4].settings["model.init_args.optim.lr"] == 0.3


def test_a_cells_command_trains_it_alone_in_its_folder(tmp_path):
    spec = read_grid(grid_file(tmp_path, args={"trainer.max_steps": 3}, axes={"attention": ATTENTION, "seed": SEED}))
    argv = cell_command(spec, cells(spec)[5], tmp_path / "out" / "cells" / "poly3-scaled" / "seed2")
    assert argv[1:6] == ["-m", "polyattn_lightning", "fit", "--config", str(QUICKSTART.resolve())]
    assert argv[6:] == [
        "--trainer.max_steps=3",
        '--model.init_args.attention={"name": "poly3", "scale": "inv_sqrt_n"}',
        "--seed_everything=2",
        f"--trainer.logger.init_args.save_dir={tmp_path / 'out' / 'cells' / 'poly3-scaled'}",
        "--trainer.logger.init_args.name=",
        "--trainer.logger.init_args.version=seed2",
        f"--trainer.default_root_dir={tmp_path / 'out' / 'cells' / 'poly3-scaled' / 'seed2'}",
    ]
    # the command parses as the cell's settings: the CLI's own config of it
    config = cli.make_cli(argv[4:], run=False).config
    assert config.model.init_args.attention == {"name": "poly3", "scale": "inv_sqrt_n"} and config.seed_everything == 2
    assert config.trainer.logger.init_args.save_dir == str(tmp_path / "out" / "cells" / "poly3-scaled")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            {"axes": {"attention": ATTENTION}, "axis": 1},
            r"grid\.yaml: unknown key axis \(did you mean axes\?\); "
            r"expected one of name, base, args, axes",
        ),
        ({"axes": {"attention": {**ATTENTION, "values": []}}}, r"grid\.yaml: axes\.attention: values is empty"),
        ({"axes": {}}, r"grid\.yaml: axes is empty"),
        (
            {"axes": {"attention": ATTENTION, "seed": SEED}, "zip": [["attention", "seed"]]},
            r"zip \['attention', 'seed'\]: axes that move together need as many values each \(attention has 3, "
            r"seed has 2\)",
        ),
        (
            {
                "axes": {
                    "a": {"key": "seed_everything", "values": {"x": 1, "y": 2}},
                    "b": {"key": "trainer.max_steps", "values": {"x": 1}},
                },
                "zip": [["a", "b"]],
            },
            r"zip \['a', 'b'\]: axes that move together need as many values each",
        ),
        ({"axes": {"seed": {"key": "seed_everything", "values": [1, 1]}}}, r"grid\.yaml: two cells are named 1"),
        (
            {"axes": {"seed": {"key": "seed_everything", "values": [1], "label": "s/{}"}}},
            r"axes\.seed: label 's/1': expected letters, digits and \. _ = \+ - \(it names a folder\)",
        ),
        (
            {"axes": {"attention": {**ATTENTION, "values": [{"name": "poly3"}]}}},
            r"axes\.attention: values\[0\] is a dict: give the values as a mapping label -> value",
        ),
        (
            {"axes": {"seed": SEED}, "report": {"seeds": "seeds"}},
            r"grid\.yaml: report\.seeds: 'seeds' is not an axis \(did you mean 'seed'\?\); axes: seed$",
        ),
        (
            {"axes": {"attention": ATTENTION}, "report": {"baseline": {"attention": "softmx"}}},
            r"grid\.yaml: report\.baseline: 'softmx' is not a label of axis 'attention'; labels: softmax, poly3",
        ),
        (
            {"axes": {"seed": SEED}, "args": {"seed_everything": 3}},
            r"seed_everything is set in args and by axes\.seed; expected one of them",
        ),
        (
            {"axes": {"seed": SEED}, "base": "../configs/classification/missing.yaml"},
            r"grid\.yaml: base \.\./configs/classification/missing\.yaml: no such config file \(",
        ),
    ],
)
def test_a_bad_grid_file_is_one_line_naming_the_file_and_key(tmp_path, content, message):
    with pytest.raises((ConfigError, MissingPathError)) as error:
        read_grid(grid_file(tmp_path, **content))
    assert re.search(message, str(error.value)), str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("axis", "message"),
    [
        (
            {"key": "model.init_args.atention", "values": ["relu"]},
            r"grid\.yaml: axes\.x relu: model\.init_args\.atention is not an option of ClassificationModule "
            r"\(did you mean model\.init_args\.attention\?\)",
        ),
        (
            {"key": "trainer.max_step", "values": [3]},
            r"grid\.yaml: axes\.x 3: unknown option --trainer\.max_step \(did you mean --trainer\.max_steps\?\)",
        ),
        (
            {"key": "trainer.max_steps", "values": ["three"]},
            r"grid\.yaml: axes\.x three: Parser key \"trainer\.max_steps\": Expected a <class 'int'>\. "
            r"Got value: three",
        ),
        (
            {"key": "model.init_args.attention", "values": ["poly9"]},
            r"grid\.yaml: axes\.x poly9: model\.init_args\.attention: poly9: the power must be an integer from 1 to 8",
        ),
    ],
)
def test_an_axis_key_or_value_the_cli_refuses_is_named_with_the_closest_key(tmp_path, axis, message):
    spec = read_grid(grid_file(tmp_path, axes={"x": axis}))
    with pytest.raises(ConfigError) as error:
        check_keys(spec)
    assert re.search(message, str(error.value)), str(error.value)
    assert "\n" not in str(error.value)


def test_a_base_without_a_folder_logger_is_refused(tmp_path):
    spec = read_grid(grid_file(tmp_path, args={"trainer.logger": False}, axes={"seed": SEED}))
    with pytest.raises(
        ConfigError,
        match=r"trainer\.logger is False; a grid cell's run folder is its "
        r"TensorBoardLogger's",
    ):
        check_keys(spec)


def test_the_command_line_says_a_bad_grid_in_one_line_with_status_2(tmp_path, capsys):
    path = grid_file(tmp_path, axes={"x": {"key": "model.init_args.atention", "values": ["relu"]}})
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["grid", str(path), "--dry-run"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.splitlines()[0] == (
        f"error: {path}: axes.x relu: model.init_args.atention is not an option of ClassificationModule "
        "(did you mean model.init_args.attention?)"
    )
    assert "Traceback" not in err
    assert not (tmp_path / "runs").exists()  # nothing written
