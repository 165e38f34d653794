"""The opt-in standard callbacks (EMA, attention maps) switched on from the command line by their short key, no
YAML of one's own needed; the maps' probe spread over the classes of an image folder sorted by class."""
from __future__ import annotations

from pathlib import Path

import torch
import yaml
from test_first_hour import CLASSES, assert_short_error, run, write_config, write_folder

from polyattn_lightning.data import ImageFolderDataModule

SHORT = ["--trainer.limit_train_batches", "2", "--trainer.max_epochs", "1", "--trainer.enable_progress_bar", "false",
         "--callbacks_off", "[norms]"]
RUNS = Path("runs") / "classification" / "folder"


def saved(project: Path, version: int) -> tuple[dict, dict]:
    """The saved config and the last checkpoint's callback states of ``version_<version>``."""
    run_dir = project / RUNS / f"version_{version}"
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    return config, checkpoint["callbacks"]


def test_opt_in_callbacks_run_by_their_short_key_and_the_maps_probe_spans_the_classes(tmp_path: Path):
    # 4 validation images a class, sorted by class: the first batch of 4 holds only the first class
    root = write_folder(tmp_path / "imgs", train=4, val=4)
    write_config(tmp_path / "folder.yaml", root)
    results = run(
        tmp_path,
        ["fit", "--config", "folder.yaml", *SHORT, "--attention_maps.probe_size", "4"],
        ["fit", "--config", "folder.yaml", *SHORT, "--callbacks_on", "[ema]"],
        ["fit", "--config", "folder.yaml", *SHORT],
        ["fit", "--config", "folder.yaml", *SHORT, "--callbacks_on", "[emma]"],
    )
    for result in results[:3]:
        assert result["rc"] == 0, result["output"]

    maps = tmp_path / RUNS / "version_0" / "attention_maps"
    assert sorted(path.name for path in maps.iterdir()) == ["step0000002_heatmaps.png", "step0000002_overlay.png"]
    assert "attention_maps/step0000002_heatmaps.png" in results[0]["output"]  # the run's "wrote ..." line
    config, states = saved(tmp_path, 0)
    assert config["callbacks_on"] == ["attention_maps"]  # the saved config resumes with the maps
    assert "EMAWeightAveraging" not in states

    config, states = saved(tmp_path, 1)
    assert config["callbacks_on"] == ["ema"] and "EMAWeightAveraging" in states
    assert not (tmp_path / RUNS / "version_1" / "attention_maps").exists()

    config, states = saved(tmp_path, 2)
    assert config["callbacks_on"] == [] and "EMAWeightAveraging" not in states and "AttentionMaps" not in states
    assert not (tmp_path / RUNS / "version_2" / "attention_maps").exists()

    assert_short_error(results[3], "callbacks_on", "ema", "attention_maps", max_lines=12)

    # the probe the maps were drawn on, told apart by image: one sample of each class, then the first class again
    probe = saved(tmp_path, 0)[1]["AttentionMaps"]["probe"]
    data = ImageFolderDataModule(root=str(root), img_size=16, batch_size=4, num_workers=0)
    data.setup("fit")
    images = torch.stack([data.val_set[index][0] for index in range(len(data.val_set))])
    labels = [data.val_set[index][1] for index in range(len(data.val_set))]
    matches = [int((images - sample).flatten(1).abs().amax(1).argmin()) for sample in probe]
    assert all(torch.allclose(images[index], sample, atol=1e-5) for index, sample in zip(matches, probe))
    assert [CLASSES[labels[index]] for index in matches] == ["cat", "dog", "fox", "cat"]
