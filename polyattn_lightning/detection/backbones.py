"""The project's backbones in mmdet's ``MODELS`` registry, usable as ``backbone=dict(type='XCiTBackbone', ...)``."""

from mmdet.registry import MODELS

from ..models.xcit_detection import XCiTBackbone

MODELS.register_module(name="XCiTBackbone", module=XCiTBackbone)

__all__ = ["XCiTBackbone"]
