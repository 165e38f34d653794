"""Models this project defines itself (where timm or mmdet has none to switch)."""

from .lra_encoder import LRAAttention, LRAClassifier, LRAEncoder
from .xcit_detection import XCiTBackbone

__all__ = ["LRAAttention", "LRAClassifier", "LRAEncoder", "XCiTBackbone"]
