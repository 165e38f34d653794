"""Everything that binds this project to mmdet/mmcv.

Importing this package first makes mmcv's compiled ops available from torchvision's kernels
(:mod:`.mmcv_ops`; a compiled mmcv takes precedence), so mmdet's models, data sets, transforms
and metrics import and run with mmcv-lite. Import it before mmdet's models; importing it after a
failed ``import mmdet.models`` also works.
"""
from .mmcv_ops import MMCVOpUnavailable, install

install()

__all__ = ["MMCVOpUnavailable", "install"]
