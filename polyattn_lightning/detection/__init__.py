"""Everything that binds this project to mmdet/mmcv.

Importing this package makes mmcv's compiled ops available from torchvision's kernels
(:mod:`.mmcv_ops`; a compiled mmcv takes precedence), so mmdet's models, data sets, transforms
and metrics import and run with mmcv-lite; it then fills mmdet's registries (mmdet's own modules
and :mod:`.backbones`). It works whether or not mmdet or ``mmcv.ops`` was imported (or failed to
import) before. Build models with ``mmdet.registry.MODELS.build(cfg)``.
"""
from .mmcv_ops import MMCVOpUnavailable, install

install()

from mmdet.utils import register_all_modules  # noqa: E402  (needs the ops installed)

register_all_modules(init_default_scope=False)  # imports mmdet's models, data sets, transforms, metrics

from .backbones import XCiTBackbone  # noqa: E402

__all__ = ["MMCVOpUnavailable", "XCiTBackbone", "install"]
