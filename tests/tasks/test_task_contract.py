"""tasks/base.py's contract on the three tasks: values from the data, one source per setting, old runs, _base_."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from training_helpers import write_jpeg
from training_helpers import CONFIGS, QUICKSTART, experiment_configs, fit

from polyattn_lightning import cli
from polyattn_lightning.attention import attention_modules
from polyattn_lightning.callbacks import AttentionNorms
from polyattn_lightning.checkpoint import load_checkpoint
from polyattn_lightning.data.lra.base import seeded_split
from polyattn_lightning.errors import ConfigError
from polyattn_lightning.tasks import ClassificationModule, DetectionModule, LRAModule, MixupRecipe, TaskModule
from polyattn_lightning.detection.config import load_detector_config

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter is intended")

OLD_RUN = Path(__file__).resolve().parents[1] / "fixtures" / "old_run"
DETECTOR = CONFIGS / "detection" / "model" / "mask_rcnn_xcit_quickstart.yaml"
TINY_VIT = dict(patch_size=8, embed_dim=8, depth=1, num_heads=1, mlp_ratio=1)


def switched_specs(module) -> list:
    return [layer.activation_spec for _, layer in attention_modules(module)]


# ---- the hooks' declared defaults --------------------------------------------------------------------

def test_every_task_declares_its_best_checkpoint_metric_and_builds_on_the_base():
    assert all(issubclass(task, TaskModule) for task in (ClassificationModule, DetectionModule, LRAModule))
    assert (ClassificationModule.monitor, ClassificationModule.mode) == ("val/top1", "max")
    assert (LRAModule.monitor, LRAModule.mode) == ("val/top1", "max")
    assert (DetectionModule.monitor, DetectionModule.mode) == ("val/bbox_mAP", "max")


def test_attention_is_switched_on_the_module_the_hook_names():
    classifier = ClassificationModule("vit_tiny_patch16_224", num_classes=3, img_size=16, model_kwargs=TINY_VIT,
                                      attention="relu")
    assert switched_specs(classifier.model) == ["relu"]
    lra = LRAModule(attention="poly1", vocab_size=8, num_classes=2, max_length=16, two_tower=False)
    assert switched_specs(lra.model) == ["poly1", "poly1"]  # LRAClassifier itself is built with softmax


def test_without_a_class_count_the_model_waits_for_the_data_and_saves_its_count():
    module = ClassificationModule("vit_tiny_patch16_224", model_kwargs=TINY_VIT)
    assert module.model is None  # built in configure_model, once the DataModule is set up
    with pytest.raises(ConfigError, match="ClassificationModule needs num_classes"):
        module.configure_model()


def test_every_experiment_config_is_in_a_family_whose_tests_build_each():
    """tests/{classification,detection,lra,hf} build every config under configs/<family> (test_experiment_config_builds,
    LRA's test_config_composes_to_the_recipe_and_builds); a config elsewhere would be built by none."""
    families = {path.relative_to(CONFIGS).parts[0] for path in experiment_configs(CONFIGS)}
    assert families == {"classification", "detection", "lra", "hf"}


# ---- the same unchanged quickstart config on data with another class count -----------------------------

def test_the_classification_quickstart_trains_a_three_class_image_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for split, count in (("train", 4), ("val", 2)):
        for label, name in enumerate(("cat", "dog", "fox")):
            for i in range(count):
                write_jpeg(tmp_path / "folder" / split / name / f"{i}.jpg", seed=10 * label + i, size=20)
    run = fit("--config", str(QUICKSTART), "--data", str(CONFIGS / "classification" / "data" / "imagenet.yaml"),
              "--data.root", str(tmp_path / "folder"), "--data.img_size", "16", "--data.num_workers", "0",
              "--data.batch_size", "4", "--trainer.max_epochs", "1", "--trainer.limit_val_batches", "1")
    model = run.model
    assert (model.hparams.num_classes, model.hparams.img_size) == (3, 16)
    assert model.model.head.out_features == 3 and model.mixup is None
    ckpt = tmp_path / "runs" / "classification" / "quickstart" / "version_0" / "checkpoints" / "last.ckpt"
    saved = load_checkpoint(ckpt)["hyper_parameters"]
    assert (saved["num_classes"], saved["img_size"]) == (3, 16)  # the values used, for rebuilding without data
    rebuilt = ClassificationModule.load_from_checkpoint(ckpt, weights_only=True)
    assert rebuilt.model.head.out_features == 3


# ---- one source per setting --------------------------------------------------------------------------

def detector(**changes) -> dict:
    config = load_detector_config(DETECTOR)
    config["backbone"].update(embed_dim=32, depth=4, num_heads=2, **changes)
    config["neck"]["in_channels"] = [32] * 4
    return config


def test_the_backbone_attention_is_read_from_one_place():
    spec = {"name": "poly3", "scale": 0.0714}
    from_mapping = DetectionModule(detector(attention=spec), num_classes=2)  # the case: it ran softmax
    assert switched_specs(from_mapping.detector.backbone) == [spec] * 4
    from_module = DetectionModule(detector(), attention="relu", num_classes=2)
    assert switched_specs(from_module.detector.backbone) == ["relu"] * 4
    with pytest.raises(ConfigError, match=r"backbone attention is given twice: model.init_args.attention 'relu' "
                                          r"and detector.backbone.attention \{'name': 'poly3'"):
        DetectionModule(detector(attention=spec), attention="relu", num_classes=2)


def test_backbone_weights_and_class_counts_are_given_in_one_place():
    with pytest.raises(ConfigError, match="detector.backbone.pretrained: give the backbone weights as "
                                          "model.init_args.pretrained"):
        DetectionModule(detector(pretrained="weights.pth"), num_classes=2)
    config = detector()
    for head in ("bbox_head", "mask_head"):
        config["roi_head"][head]["num_classes"] = 4
    assert DetectionModule(config).detector.roi_head.bbox_head.num_classes == 4  # the heads' count, alone
    with pytest.raises(ConfigError, match="class count is given twice: model.init_args.num_classes 2 and the "
                                          "detector config's heads num_classes 4"):
        DetectionModule(config, num_classes=2)


# ---- detector configs as a base plus overrides ---------------------------------------------------------

def test_base_is_deep_merged_dicts_by_key_lists_replaced(tmp_path):
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(
        {"type": "MaskRCNN", "neck": {"type": "FPN", "in_channels": [1, 2, 3], "num_outs": 5}, "keep": {"a": 1}}))
    (tmp_path / "middle.yaml").write_text(yaml.safe_dump({"_base_": "base.yaml", "neck": {"num_outs": 4}}))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "top.yaml").write_text(yaml.safe_dump(
        {"_base_": "../middle.yaml", "neck": {"in_channels": [7]}, "keep": {"b": 2}}))
    assert load_detector_config(tmp_path / "sub" / "top.yaml") == {
        "type": "MaskRCNN", "neck": {"type": "FPN", "in_channels": [7], "num_outs": 4}, "keep": {"a": 1, "b": 2}}
    with pytest.raises(FileNotFoundError, match="missing.yaml does not exist"):
        load_detector_config({"_base_": str(tmp_path / "missing.yaml")})


def test_the_hyperparameters_keep_the_merged_mapping():
    module = DetectionModule(str(DETECTOR), num_classes=2)
    assert "_base_" not in module.hparams.detector
    assert module.hparams.detector["backbone"]["model_name"] == "xcit_nano_12_p16_224"  # the override
    assert module.hparams.detector["roi_head"]["bbox_roi_extractor"]["roi_layer"]["type"] == "RoIAlign"  # the base's


# ---- old runs --------------------------------------------------------------------------------------------

def test_an_old_run_resumes_from_its_saved_config_and_checkpoint(tmp_path, monkeypatch):
    """tests/fixtures/old_run was written before the task base (``recipe:`` block, num_classes stated)."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(OLD_RUN, tmp_path / "old_run")
    with pytest.warns(FutureWarning, match="model.init_args.recipe is deprecated"):
        run = fit("--config", "old_run/config.yaml", "--ckpt_path", "old_run/last.ckpt", "--trainer.max_steps", "4",
                  "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1")
    assert run.trainer.global_step == 4
    assert run.model.optim.lr == 2e-3 and "recipe" not in run.model.hparams  # mapped onto the new keys
    # the callbacks it lists run, as they ran (its plain last ModelCheckpoint, not the standard LastCheckpoint)
    names = sorted(type(cb).__name__ for cb in run.trainer.callbacks if isinstance(cb, ModelCheckpoint))
    assert names == ["ModelCheckpoint", "ModelCheckpoint"]
    assert [cb.every_n_steps for cb in run.trainer.callbacks if isinstance(cb, AttentionNorms)] == [50]
    saved = load_checkpoint(tmp_path / "runs" / "old_run" / "version_0" / "checkpoints" / "last.ckpt")
    assert saved["hyper_parameters"]["optim"]["lr"] == 2e-3 and "recipe" not in saved["hyper_parameters"]


def test_an_old_checkpoint_with_pickled_recipes_loads_weights_only():
    with pytest.warns(FutureWarning, match="recipe is deprecated"):
        module = ClassificationModule.load_from_checkpoint(OLD_RUN / "api.ckpt", weights_only=True)
    assert module.optim.lr == 2e-3 and module.mixup_recipe == MixupRecipe(label_smoothing=0.1)
    state = torch.load(OLD_RUN / "api.ckpt", weights_only=True)["state_dict"]
    assert torch.equal(module.state_dict()["model.head.weight"], state["model.head.weight"])


def test_a_setting_in_both_the_old_recipe_and_its_new_key_is_an_error():
    old = yaml.safe_load((OLD_RUN / "config.yaml").read_text())["model"]["init_args"]
    with pytest.raises(ConfigError, match="model.init_args.drop_path_rate is given twice, as 0.2 and as "
                                          "recipe.drop_path_rate 0.0"), pytest.warns(FutureWarning):
        ClassificationModule(**{**old, "drop_path_rate": 0.2})


# ---- splits that the data cannot give ---------------------------------------------------------------

def test_a_split_larger_than_the_data_or_empty_is_one_error_naming_the_sizes():
    data = list(range(10))
    assert [len(part) for part in seeded_split(data, [7, 3], seed=0)] == [7, 3]
    with pytest.raises(ConfigError, match=r"cannot split 10 samples into training -5, validation \(val_size\) 15: "
                                          r"an empty split \(training -5\)"):
        seeded_split(data, [10 - 15, 15], seed=0, names=["training", "validation (val_size)"])
    with pytest.raises(ConfigError, match="cannot split 10 samples into split 0 8, split 1 4: 12 samples asked for"):
        seeded_split(data, [8, 4], seed=0)


def test_a_deprecated_key_on_the_command_line_overrides_the_one_field_it_names():
    """``--model.recipe.optim.lr 0`` on a config written with the new keys: read as ``--model.optim.lr 0`` (the
    config's other optim fields kept), with one deprecation line; never "given twice"."""
    new = cli.make_cli(["--config", str(QUICKSTART), "--model.optim.lr", "0", "--model.drop_path_rate", "0.1"],
                       run=False).model
    with pytest.warns(FutureWarning) as caught:
        old = cli.make_cli(["--config", str(QUICKSTART), "--model.recipe.optim.lr", "0",
                            "--model.init_args.recipe.drop_path_rate=0.1"], run=False).model
    messages = [str(w.message) for w in caught if "is deprecated: it is" in str(w.message)]
    assert messages == ["--model.recipe.optim.lr is deprecated: it is --model.optim.lr now (given as that)",
                        "--model.init_args.recipe.drop_path_rate is deprecated: it is "
                        "--model.init_args.drop_path_rate now (given as that)"]
    assert old.optim == new.optim and old.optim.lr == 0 and old.optim.weight_decay == 0.05  # the config's others
    assert old.hparams.drop_path_rate == 0.1 and old.hparams.get("recipe") is None
    # the later of the two spellings wins, as for any key given twice on the command line
    later = cli.make_cli(["--config", str(QUICKSTART), "--model.recipe.optim.lr", "0", "--model.optim.lr", "0.5"],
                         run=False).model
    assert later.optim.lr == 0.5
