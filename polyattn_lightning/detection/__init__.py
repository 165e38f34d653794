"""Everything that binds this project to mmdet/mmcv.

Importing this package makes mmcv's compiled ops available from torchvision's kernels
(:mod:`.mmcv_ops`; a compiled mmcv takes precedence), so mmdet's models, data sets, transforms
and metrics import and run with mmcv-lite; it then fills mmdet's registries (mmdet's own modules
and :mod:`.backbones`; mmengine's default scope becomes ``mmdet``). It works whether or not mmdet
or ``mmcv.ops`` was imported (or failed to import) before. Build models with
``mmdet.registry.MODELS.build(cfg)``.
"""

from .mmcv_ops import MMCVOpUnavailable, install

install()

from mmdet.utils import register_all_modules  # noqa: E402  (needs the ops installed)

# imports mmdet's models, data sets, transforms and metrics, and makes 'mmdet' the default scope, so that
# nested types (DetDataPreprocessor, FPN...) and pipelines build from mmdet's registries
register_all_modules(init_default_scope=True)

from .backbones import XCiTBackbone  # noqa: E402

__all__ = ["MMCVOpUnavailable", "XCiTBackbone", "install"]
