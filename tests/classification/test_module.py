"""ClassificationModule and its optimizer: attention switch, offline fine-tuning, lr rule, weight-decay groups."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import timm
import torch
from safetensors.torch import save_file

from polyattn_lightning.attention import attention_modules
from polyattn_lightning.checkpoint import CheckpointLoadError
from polyattn_lightning.tasks import ClassificationModule, OptimRecipe
from polyattn_lightning.models.timm_builder import resolve_pretrained_file
from polyattn_lightning.tasks.optim import build_optimizer, build_scheduler, global_batch_size

TINY_VIT = dict(model_name="vit_tiny_patch16_224", num_classes=10, img_size=16)
TINY_VIT_KWARGS = dict(patch_size=4, embed_dim=32, depth=2, num_heads=2)


def tiny_module(attention="softmax", **kwargs) -> ClassificationModule:
    torch.manual_seed(0)
    return ClassificationModule(**TINY_VIT, model_kwargs=TINY_VIT_KWARGS, attention=attention, **kwargs).eval()


def tiny_timm_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model(TINY_VIT["model_name"], num_classes=10, img_size=16, **TINY_VIT_KWARGS).eval()


@torch.no_grad()
def test_softmax_module_matches_timm_and_poly3_changes_outputs():
    images = torch.randn(4, 3, 16, 16)
    softmax, poly3, reference = tiny_module("softmax"), tiny_module("poly3"), tiny_timm_model()
    assert len(attention_modules(poly3.model)) == 2
    for model in (softmax.model, poly3.model):
        model.load_state_dict(reference.state_dict())  # same keys: the switch keeps timm's parameters
    torch.testing.assert_close(softmax(images), reference(images), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(poly3(images), reference(images), atol=1e-3)


@pytest.mark.parametrize("layout", ["file", "hf_cache", "lightning_ckpt"])
def test_fine_tune_from_local_softmax_weights_into_poly3(tmp_path: Path, layout: str):
    """timm loads the local file (no download); a new class count gets a fresh head, all else is kept."""
    source = tiny_timm_model()
    if layout == "file":
        weights = tmp_path / "vit_tiny.safetensors"
        save_file(source.state_dict(), weights)
    elif layout == "lightning_ckpt":  # a ClassificationModule run of this project
        weights = tmp_path / "softmax_run.ckpt"
        state = {f"model.{name}": value for name, value in source.state_dict().items()}
        torch.save({"state_dict": state, "hyper_parameters": {"num_classes": 10}}, weights)
    else:  # ~/.cache/huggingface/hub/models--timm--<name>/{refs/main, snapshots/<revision>/model.safetensors}
        weights = tmp_path / "models--timm--vit_tiny"
        snapshot = weights / "snapshots" / "abc123"
        snapshot.mkdir(parents=True)
        save_file(source.state_dict(), snapshot / "model.safetensors")
        (weights / "refs").mkdir()
        (weights / "refs" / "main").write_text("abc123")
    module = tiny_module({"name": "poly3", "scale": 0.25}, pretrained=str(weights))
    loaded = module.model.state_dict()
    for name, tensor in source.state_dict().items():
        # a weight file's head counts as made for timm's default 1000 classes; a run's checkpoint says its own
        if layout == "lightning_ckpt" or not name.startswith("head."):
            assert torch.equal(loaded[name], tensor), name
    assert {layer.activation.name for _, layer in attention_modules(module.model)} == {"poly3"}


def test_missing_pretrained_file_is_named(tmp_path: Path):
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(FileNotFoundError, match=rf"pretrained weights {missing} not found"):
        tiny_module(pretrained=str(missing))


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_truncated_pretrained_file_is_named(tmp_path: Path, suffix: str):
    """timm's own errors for these are ``header too large`` / ``[Errno 22] Invalid argument``, naming no file."""
    good, bad = tmp_path / f"good{suffix}", tmp_path / f"bad{suffix}"
    state = tiny_timm_model().state_dict()
    save_file(state, good) if suffix == ".safetensors" else torch.save(state, good)
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(CheckpointLoadError, match=rf"{bad} .*truncated or corrupt"):
        tiny_module(pretrained=str(bad))


def test_hf_cache_directory_with_several_snapshots_needs_one_named(tmp_path: Path):
    for revision in ("a", "b"):
        (tmp_path / "snapshots" / revision).mkdir(parents=True)
        (tmp_path / "snapshots" / revision / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="several model.safetensors"):
        resolve_pretrained_file(tmp_path)


def test_unknown_model_name_lists_close_matches():
    with pytest.raises(ValueError, match=r"unknown timm model 'vit_smal_patch16_224'.*vit_small_patch16_224"):
        ClassificationModule("vit_smal_patch16_224", num_classes=10)


def test_unknown_activation_lists_the_registered_ones():
    with pytest.raises(KeyError, match=r"unknown attention activation 'cubic'.*poly\{p\}.*softmax"):
        tiny_module("cubic")


def test_lr_rule_uses_the_global_batch():
    recipe = OptimRecipe(lr=5e-4, reference_batch=512)
    trainer = SimpleNamespace(world_size=8, accumulate_grad_batches=2)  # e.g. 2 nodes x 4 GPUs
    assert global_batch_size(trainer, 64) == 1024
    assert recipe.scaled_lr(1024) == pytest.approx(1e-3)
    assert OptimRecipe(lr=5e-4, reference_batch=None).scaled_lr(1024) == 5e-4


def test_warmup_then_cosine_to_the_floor():
    recipe = OptimRecipe(warmup_epochs=2, warmup_lr=0.0, min_lr=0.1)
    optimizer = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    scheduler = build_scheduler(optimizer, recipe, total_steps=100, steps_per_epoch=10)

    def lr_at(step: int) -> float:
        scheduler.step_update(num_updates=step)
        return optimizer.param_groups[0]["lr"]

    assert [lr_at(step) for step in (0, 10, 20)] == pytest.approx([0.0, 0.5, 1.0])  # linear warmup over 20 steps
    assert lr_at(60) == pytest.approx(0.55)  # half-way through the 80 cosine steps: (1 + 0.1) / 2
    assert lr_at(100) == pytest.approx(0.1)


def test_weight_decay_skips_norms_biases_and_position_embeddings():
    model = tiny_timm_model()
    optimizer = build_optimizer(model, OptimRecipe(weight_decay=0.05), lr=1e-3)
    names = {id(param): name for name, param in model.named_parameters()}
    decayed = {names[id(p)] for group in optimizer.param_groups if group["weight_decay"] > 0 for p in group["params"]}
    not_decayed = set(names.values()) - decayed
    assert {"pos_embed", "cls_token", "norm.weight", "norm.bias", "blocks.0.attn.qkv.bias"} <= not_decayed
    assert decayed and all(name.endswith(".weight") and "norm" not in name for name in decayed)
