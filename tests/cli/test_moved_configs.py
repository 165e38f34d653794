"""The per-activation experiment configs that became one base config per model and a grid per paper table: a path of
an earlier release given to ``--config`` fails in one line that says which base config and settings make that run,
and which grid holds its paper table; each replacement named exists and is the grid's own cell."""

from __future__ import annotations

import shutil

import pytest
import yaml

from polyattn_lightning.attention import get_activation
from polyattn_lightning.cli.prechecks import MOVED_CONFIGS, check_moved_configs
from polyattn_lightning.errors import MissingPathError
from training_helpers import CONFIGS, QUICKSTART, error_lines, grid_cells, resolved_config, run_commands

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter is intended")


def test_every_moved_config_is_gone_and_its_replacements_exist():
    """75 removed files: 33 ImageNet, 5 Tiny-ImageNet, 5 COCO, 32 LRA; their base configs and grids are there."""
    families = [key.split("/")[1] for key in MOVED_CONFIGS]
    counts = {family: families.count(family) for family in ("imagenet", "tiny_imagenet", "coco")}
    assert counts == {"imagenet": 33, "tiny_imagenet": 5, "coco": 5} and len(MOVED_CONFIGS) - sum(counts.values()) == 32
    for old, (base, _, grid) in MOVED_CONFIGS.items():
        assert not (CONFIGS / old).exists(), old
        assert (CONFIGS / base).is_file(), base
        assert grid is None or (CONFIGS / grid).is_file(), grid


def test_each_removed_run_is_a_cell_of_its_grid():
    """The attention a message gives for a removed config is the value of one of its grid's cells (the cell that
    runs what the file ran), on the grid's base or on the model the cell's model axis names."""
    for old, (base, settings, grid) in MOVED_CONFIGS.items():
        if grid is None:
            continue
        given = yaml.safe_load(settings.split("--model.init_args.attention ", 1)[1].split(" --", 1)[0].strip("'"))
        _, _, cells = grid_cells(CONFIGS / grid)
        model = yaml.safe_load((CONFIGS / base).read_text())["model"]["init_args"].get("model_name")
        matching = [
            name
            for name, _, cell in cells
            if get_activation(cell["model.init_args.attention"]) == get_activation(given)
            and cell.get("model.init_args.model_name", model) == model
            and (cell.get("model.init_args") or {}).get("model_name", model) == model
        ]
        assert matching, (old, settings)


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (
            "configs/classification/imagenet/vit_small_poly3.yaml",
            "configs/classification/imagenet/vit_small_poly3.yaml was removed (one base config per model, a grid per "
            "paper table): the same run is --config configs/classification/imagenet/vit_small.yaml "
            "--model.init_args.attention '{name: poly3, scale: 0.07142857142857142}'; its paper table: polyattn grid "
            "configs/grids/imagenet_table2.yaml",
        ),
        (
            "/elsewhere/configs/lra/listops/listops_poly1_attn_dropout0.yaml",
            "/elsewhere/configs/lra/listops/listops_poly1_attn_dropout0.yaml was removed (one base config per model, a "
            "grid per paper table): the same run is --config /elsewhere/configs/lra/listops.yaml "
            "--model.init_args.attention '{name: poly1, scale: 0.0714}' --model.init_args.attn_dropout 0.0; its paper "
            "table: polyattn grid /elsewhere/configs/grids/lra_table4/listops.yaml",
        ),
        (
            "tiny_imagenet/vit_tiny_poly3_inv_sqrt_n.yaml",  # from inside configs/classification: named from the root
            "tiny_imagenet/vit_tiny_poly3_inv_sqrt_n.yaml was removed (one base config per model, a grid per paper "
            "table): the same run is --config configs/classification/tiny_imagenet/vit_tiny.yaml "
            "--model.init_args.attention '{name: poly3, scale: inv_sqrt_n}'; its paper table: polyattn grid "
            "configs/grids/tiny_imagenet_table1.yaml",
        ),
        (
            "configs/lra/pathx/pathx_poly3.yaml",
            "configs/lra/pathx/pathx_poly3.yaml was removed (one base config per model, a grid per paper table): the "
            "same run is --config configs/lra/pathx.yaml",
        ),
    ],
)
def test_a_removed_path_names_what_replaced_it(tmp_path, monkeypatch, given, expected):
    """From Python: the one-line error; nothing else is read."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(MissingPathError) as error:
        check_moved_configs(["fit", "--config", given, "--trainer.max_epochs", "1"])
    assert str(error.value) == expected


def test_the_command_line_fails_in_one_line_with_status_2(tmp_path):
    """``fit --config <removed path>`` (also ``--config=``, and ``validate``) exits 2 with that one error line,
    before anything is built or written."""
    old = "configs/detection/coco/mask_rcnn_xcit_small_12_poly3_3x.yaml"
    argvs = [["fit", "--config", old], ["validate", f"--config={old}", "--trainer.max_epochs", "1"]]
    for result in run_commands(tmp_path, *argvs):
        assert result["rc"] == 2, result["output"]
        [line] = error_lines(result["output"])
        assert line == (
            f"error: {old} was removed (one base config per model, a grid per paper table): the same run is --config "
            "configs/detection/coco/mask_rcnn_xcit_small_12_3x.yaml --model.init_args.attention '{name: poly3, scale: "
            "0.07142857142857142}' --model.init_args.pretrained <the poly3 ImageNet run's last.ckpt>; its paper table: "
            "polyattn grid configs/grids/coco_table3.yaml"
        )
        assert "Traceback" not in result["output"] and not (tmp_path / "runs").exists()


def test_a_file_the_user_keeps_at_a_removed_path_is_read_as_it_is(tmp_path, monkeypatch, capsys):
    """A config of the user's own at an old path (a copy kept from an earlier release) is theirs: it runs."""
    monkeypatch.chdir(tmp_path)
    kept = tmp_path / "configs" / "classification" / "imagenet" / "vit_small_poly3.yaml"
    kept.parent.mkdir(parents=True)
    shutil.copy(QUICKSTART, kept)
    (kept.parent / "trainer").symlink_to(QUICKSTART.parent / "trainer")  # the pieces it names, relative to it
    (kept.parent / "recipes").symlink_to(QUICKSTART.parent / "recipes")
    (kept.parent / "data").symlink_to(QUICKSTART.parent / "data")
    config = resolved_config(capsys, kept.relative_to(tmp_path))
    assert config["model"]["init_args"]["model_name"] == "vit_tiny_patch16_224"  # the kept file's, not a message
