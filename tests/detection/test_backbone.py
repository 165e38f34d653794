"""XCiTBackbone: strides and channels, the blocks its maps come from, attention switching, weight loading."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import timm
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

import polyattn_lightning.detection  # noqa: F401  (registers XCiTBackbone with mmdet)
from mmdet.registry import MODELS
from polyattn_lightning.attention import attention_modules
from polyattn_lightning.checkpoint import CheckpointLoadError
from polyattn_lightning.errors import ConfigError, MissingPathError, UnknownNameError
from polyattn_lightning.models.xcit_detection import XCiTBackbone
from polyattn_lightning.tasks import ClassificationModule

TINY = dict(embed_dim=32, num_heads=2)  # head dim 16; the patch embedding needs embed_dim divisible by 8
MODELS_BY_DEPTH = {12: "xcit_nano_12_p16_224", 24: "xcit_tiny_24_p16_224"}


def tiny_backbone(depth: int = 12, attention="softmax", **kwargs) -> XCiTBackbone:
    torch.manual_seed(0)
    cfg = dict(type="XCiTBackbone", model_name=MODELS_BY_DEPTH[depth], attention=attention, **TINY, **kwargs)
    return MODELS.build(cfg).eval()


def tiny_timm_xcit(depth: int = 12) -> torch.nn.Module:
    """The same network as timm builds it for classification (class attention, norm, head)."""
    torch.manual_seed(1)
    return timm.create_model(MODELS_BY_DEPTH[depth], num_classes=5, **TINY).eval()


@pytest.mark.parametrize("depth, blocks", [(12, (3, 5, 7, 11)), (24, (7, 11, 15, 23))])
@torch.no_grad()
def test_strides_channels_and_the_blocks_maps_come_from(depth, blocks):
    backbone = tiny_backbone(depth)
    assert backbone.out_indices == blocks and backbone.out_channels == (32,) * 4
    images = torch.randn(2, 3, 64, 96)  # 4 x 6 patches; not square: the position encoding follows the input
    maps = backbone(images)
    assert [tuple(m.shape) for m in maps] == [(2, 32, 64 // s, 96 // s) for s in (4, 8, 16, 32)]
    # softmax through the registry is timm's XCiT: the maps are timm's block outputs, resampled
    reference = tiny_timm_xcit(depth)
    reference.load_state_dict(backbone.xcit.state_dict(), strict=False)
    tokens = reference.forward_intermediates(images, indices=list(blocks), intermediates_only=True)
    for branch, token_map, out in zip((backbone.fpn1, backbone.fpn2, backbone.fpn3, backbone.fpn4), tokens, maps):
        torch.testing.assert_close(out, branch(token_map), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(maps[2], tokens[2], atol=1e-5, rtol=1e-4)  # stride 16 is the blocks' own output


@torch.no_grad()
def test_patch_8_models_resample_to_the_same_strides():
    backbone = MODELS.build(dict(type="XCiTBackbone", model_name="xcit_nano_12_p8_224", **TINY)).eval()
    maps = backbone(torch.randn(1, 3, 64, 96))
    assert [tuple(m.shape[-2:]) for m in maps] == [(64 // s, 96 // s) for s in (4, 8, 16, 32)]


def test_classification_parts_are_not_part_of_the_backbone():
    names = set(tiny_backbone().state_dict())
    assert not {n for n in names if n.startswith(("xcit.cls_token", "xcit.cls_attn_blocks", "xcit.head", "xcit.norm."))}
    assert {"fpn1.0.weight", "fpn1.1.running_mean", "fpn1.3.weight", "fpn2.weight"} <= names


@torch.no_grad()
def test_attention_spec_switches_every_xca_layer():
    softmax = tiny_backbone(attention="softmax")
    poly3 = tiny_backbone(attention={"name": "poly3", "scale": 0.0714})
    switched = attention_modules(poly3.xcit)
    assert len(switched) == 12
    assert {(m.activation.name, m.activation_spec["scale"]) for _, m in switched} == {("poly3", 0.0714)}
    poly3.load_state_dict(softmax.state_dict())
    images = torch.randn(1, 3, 48, 64)
    for a, b in zip(softmax(images), poly3(images)):
        assert not torch.allclose(a, b, atol=1e-3)


@torch.no_grad()
def test_batchnorms_convert_to_syncbatchnorm_as_lightning_does_under_ddp():
    """``trainer.sync_batchnorm: true`` runs torch's convert_sync_batchnorm over the model: every BatchNorm of the
    backbone (patch embedding, local patch interaction, stride-4 branch) converts, with its statistics."""
    backbone = tiny_backbone()
    images = torch.randn(1, 3, 32, 48)
    expected = backbone(images)
    n_bn = sum(isinstance(m, torch.nn.BatchNorm2d) for m in backbone.modules())
    converted = torch.nn.SyncBatchNorm.convert_sync_batchnorm(backbone).eval()
    assert n_bn == 4 + 12 + 1 and sum(isinstance(m, torch.nn.SyncBatchNorm) for m in converted.modules()) == n_bn
    for a, b in zip(expected, converted(images)):  # eval mode: running statistics, no synchronisation
        torch.testing.assert_close(a, b)


def test_bad_arguments_are_named():
    with pytest.raises(ConfigError, match="needs a timm XCiT model, got 'vit_tiny_patch16_224'"):
        XCiTBackbone("vit_tiny_patch16_224")
    with pytest.raises(UnknownNameError, match="unknown timm model 'xcit_smal_12'"):
        XCiTBackbone("xcit_smal_12")
    with pytest.raises(ConfigError, match=r"4 increasing block indices below 12, got \[3, 5, 12\]"):
        XCiTBackbone(MODELS_BY_DEPTH[12], out_indices=[3, 5, 12], **TINY)


# ----------------------------------------------------------------------------- weights


def _classification_run_checkpoint(tmp_path: Path) -> Path:
    """A ClassificationModule checkpoint written mid-fit by Lightning with an EMA of the weights."""
    torch.manual_seed(2)
    module = ClassificationModule(MODELS_BY_DEPTH[12], num_classes=3, img_size=32, model_kwargs=dict(TINY))
    data = TensorDataset(torch.randn(8, 3, 32, 32), torch.randint(0, 3, (8,)))
    checkpoints = ModelCheckpoint(dirpath=tmp_path, filename="run", every_n_train_steps=3, save_top_k=-1)
    trainer = Trainer(
        accelerator="cpu",
        max_steps=3,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[EMAWeightAveraging(decay=0.5), checkpoints],
    )
    trainer.fit(module, DataLoader(data, batch_size=4))
    return tmp_path / "run.ckpt"


def test_init_from_a_classification_run_takes_its_ema_weights(tmp_path, caplog):
    ckpt = _classification_run_checkpoint(tmp_path)
    saved = torch.load(ckpt, weights_only=True)
    ema = {k.removeprefix("model."): v for k, v in saved["state_dict"].items() if k.startswith("model.")}
    current = {k.removeprefix("model."): v for k, v in saved["current_model_state"].items() if k.startswith("model.")}
    name = "blocks.0.attn.qkv.weight"
    assert not torch.equal(ema[name], current[name])  # the run's own weights are not the EMA's
    with caplog.at_level(logging.INFO, logger="polyattn_lightning.models.xcit_detection"):
        backbone = tiny_backbone(pretrained=str(ckpt))
    loaded = backbone.xcit.state_dict()
    assert all(torch.equal(loaded[k], ema[k]) for k in loaded)  # every trunk tensor comes from the EMA
    assert str(ckpt) in caplog.text and "classification parts not used" in caplog.text


@pytest.mark.parametrize("layout", ["timm_safetensors", "official_pth"])
def test_init_from_an_xcit_state_dict(tmp_path, layout, caplog):
    source = tiny_timm_xcit().state_dict()
    if layout == "timm_safetensors":
        weights = tmp_path / "xcit.safetensors"
        save_file(source, weights)
    else:  # the XCiT authors' release: {'model': ...} with the position encoding named pos_embeder
        weights = tmp_path / "xcit.pth"
        torch.save({"model": {k.replace("pos_embed.", "pos_embeder."): v for k, v in source.items()}}, weights)
    with caplog.at_level(logging.INFO, logger="polyattn_lightning.models.xcit_detection"):
        missing, unexpected = tiny_backbone(pretrained=str(weights)).load_pretrained(weights)
    assert missing == [] and "head.weight" in unexpected and "cls_token" in unexpected
    backbone = tiny_backbone(pretrained=str(weights))
    assert all(torch.equal(v, source[k]) for k, v in backbone.xcit.state_dict().items())
    assert "missing keys (left as initialised): none" in caplog.text


def test_bad_weight_files_stop_with_their_name(tmp_path):
    with pytest.raises(MissingPathError, match="pretrained weights .*absent.pth not found"):
        tiny_backbone(pretrained=str(tmp_path / "absent.pth"))
    good = tmp_path / "good.pth"
    torch.save(tiny_timm_xcit().state_dict(), good)
    truncated = tmp_path / "truncated.pth"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(CheckpointLoadError, match="truncated.pth"):
        tiny_backbone(pretrained=str(truncated))
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    with pytest.raises(CheckpointLoadError, match="garbage.safetensors are truncated or corrupt"):
        tiny_backbone(pretrained=str(garbage))
    vit = tmp_path / "vit.safetensors"
    save_file(timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=16, depth=1).state_dict(), vit)
    with pytest.raises(ConfigError, match="vit.safetensors hold no XCiT weights"):
        tiny_backbone(pretrained=str(vit))
    adapted = tmp_path / "lora.ckpt"  # a ClassificationModule's checkpoint with peft adapters on qkv
    weights = {f"model.{k}": v for k, v in tiny_timm_xcit().state_dict().items() if not k.endswith("attn.qkv.weight")}
    weights |= {
        "model.blocks.0.attn.qkv.base_layer.weight": torch.zeros(1),
        "model.blocks.0.attn.qkv.lora_A.default.weight": torch.zeros(1),
    }
    torch.save({"state_dict": weights}, adapted)
    with pytest.raises(ConfigError, match="lora.ckpt hold LoRA adapters beside their base weights"):
        tiny_backbone(pretrained=str(adapted))
    wider = tmp_path / "wider.safetensors"
    save_file(timm.create_model(MODELS_BY_DEPTH[12], embed_dim=64, num_heads=2).state_dict(), wider)
    with pytest.raises(ConfigError, match=r"wider.safetensors do not fit xcit_nano_12_p16_224: .*\(64"):
        tiny_backbone(pretrained=str(wider))
