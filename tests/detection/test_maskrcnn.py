"""XCiT Mask R-CNN + FPN from configs/detection/model, built by mmdet's registry, on CPU at small image size.

mmdet's own MaskRCNN, data preprocessor and transforms run on the torchvision-backed mmcv ops; the
samples come from mmdet's Resize + PackDetInputs, so their meta data (scale factor, shapes) is real.
"""
from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

import polyattn_lightning.detection  # noqa: F401  (mmcv ops, XCiTBackbone registered)
from mmcv.transforms import Compose
from mmdet.registry import MODELS
from mmdet.structures.mask import BitmapMasks
from mmengine.config import ConfigDict
from mmengine.dataset import pseudo_collate

from polyattn_lightning.detection.config import load_detector_config

CONFIG = Path(__file__).parents[2] / "configs" / "detection" / "model" / "mask_rcnn_xcit_s12_p16_fpn.yaml"
NUM_CLASSES = 3


def _config() -> dict:
    return load_detector_config(CONFIG)


def small_detector(attention) -> torch.nn.Module:
    """The config's detector with a narrow 12-block XCiT (same out_indices and strides), 3 classes, fewer RoIs."""
    cfg = _config()
    cfg["backbone"].update(model_name="xcit_nano_12_p16_224", embed_dim=32, num_heads=2, attention=attention)
    cfg["neck"]["in_channels"] = [32] * 4
    for head in ("bbox_head", "mask_head"):
        cfg["roi_head"][head]["num_classes"] = NUM_CLASSES
    # fewer proposals and RoIs: the RoI heads' cost, not what is tested, dominates on CPU
    cfg["train_cfg"]["rpn_proposal"]["max_per_img"] = cfg["test_cfg"]["rpn"]["max_per_img"] = 100
    cfg["train_cfg"]["rcnn"]["sampler"]["num"] = 64
    cfg["test_cfg"]["rcnn"]["max_per_img"] = 20
    torch.manual_seed(0)
    return MODELS.build(ConfigDict(cfg))


def _sample(height: int, width: int, seed: int) -> dict:
    """An image of (height, width) with two boxes and masks, resized x2 by mmdet's pipeline."""
    rng = np.random.default_rng(seed)
    masks = np.zeros((2, height, width), np.uint8)
    masks[0, 5:30, 10:40] = 1
    masks[1, 20:height - 2, 30:width - 5] = 1
    pipeline = Compose([dict(type="Resize", scale=(2 * width, 2 * height), keep_ratio=True), dict(type="PackDetInputs")])
    return pipeline(dict(
        img=rng.integers(0, 256, (height, width, 3), dtype=np.uint8), img_shape=(height, width),
        ori_shape=(height, width), img_id=seed, img_path=f"{seed}.jpg",
        gt_bboxes=np.array([[10, 5, 40, 30], [30, 20, width - 5, height - 2]], np.float32),
        gt_bboxes_labels=np.array([0, 2]), gt_ignore_flags=np.array([False, False]),
        gt_masks=BitmapMasks(masks, height, width),
    ))


@pytest.fixture(scope="module")
def batch() -> dict:
    return pseudo_collate([_sample(48, 64, 0), _sample(37, 53, 1)])  # 74 x 106 after resizing: padded to 32s


@pytest.mark.parametrize("name, depth, blocks, width", [
    ("mask_rcnn_xcit_s12_p16_fpn.yaml", 12, (3, 5, 7, 11), 384),
    ("mask_rcnn_xcit_m24_p16_fpn.yaml", 24, (7, 11, 15, 23), 512),
])
def test_configs_put_an_fpn_on_the_four_xcit_maps(name, depth, blocks, width):
    cfg = load_detector_config(CONFIG.parent / name)  # merged over its _base_
    with torch.device("meta"):  # shapes only: no memory, no initialisation time
        backbone = MODELS.build(ConfigDict(cfg["backbone"]))
    assert len(backbone.xcit.blocks) == depth and backbone.xcit.blocks[0].attn.num_heads == 8
    assert backbone.out_indices == blocks and backbone.strides == (4, 8, 16, 32)
    assert list(backbone.out_channels) == cfg["neck"]["in_channels"] == [width] * 4
    assert tuple(cfg["roi_head"]["bbox_roi_extractor"]["featmap_strides"]) == backbone.strides


def test_loss_and_backward_reach_the_backbone(batch):
    model = small_detector({"name": "poly3", "scale": 0.0714}).train()
    losses = model(**model.data_preprocessor(copy.deepcopy(batch), True), mode="loss")
    assert {"loss_rpn_cls", "loss_rpn_bbox", "loss_cls", "loss_bbox", "loss_mask"} <= set(losses)
    loss, parts = model.parse_losses(losses)
    assert torch.isfinite(loss) and loss > 0 and parts["loss_mask"] > 0
    loss.backward()
    for name in ("xcit.blocks.0.attn.qkv.weight", "xcit.blocks.11.attn.temperature", "fpn1.0.weight", "fpn2.weight"):
        grad = model.backbone.get_parameter(name).grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name


@torch.no_grad()
def test_predict_returns_boxes_and_masks_in_original_image_coordinates(batch):
    model = small_detector("softmax").eval()
    data = model.data_preprocessor(copy.deepcopy(batch), False)
    assert tuple(data["inputs"].shape[-2:]) == (96, 128)  # 96 x 128 and 74 x 106 (not a multiple of 16) padded
    original = model.predict(data["inputs"], copy.deepcopy(data["data_samples"]), rescale=True)
    resized = model.predict(data["inputs"], copy.deepcopy(data["data_samples"]), rescale=False)
    for sample, in_original, in_resized in zip(data["data_samples"], original, resized):
        height, width = sample.ori_shape
        assert sample.img_shape == (2 * height, 2 * width)
        found, on_input = in_original.pred_instances, in_resized.pred_instances
        assert len(found) > 0  # an untrained 3-class head scores ~1/4 > score_thr 0.05
        assert set(found.keys()) >= {"bboxes", "scores", "labels", "masks"}
        assert found.masks.shape[1:] == (height, width) and on_input.masks.shape[1:] == (2 * height, 2 * width)
        assert found.masks.dtype == torch.bool
        assert (found.bboxes[:, 0::2] >= 0).all() and (found.bboxes[:, 0::2] <= width).all()
        assert (found.bboxes[:, 1::2] >= 0).all() and (found.bboxes[:, 1::2] <= height).all()
        torch.testing.assert_close(found.bboxes * 2, on_input.bboxes)  # the same detections, scaled back by 2
        assert ((found.labels >= 0) & (found.labels < NUM_CLASSES)).all()
