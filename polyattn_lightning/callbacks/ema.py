"""The EMA of the weights (opt-in: ``--callbacks_on [ema]``, ``--ema.decay``, or
``configs/classification/trainer/callbacks/ema.yaml``): Lightning's ``EMAWeightAveraging``, without a warning
that does not apply to the strategies that build whole models.

Lightning's ``WeightAveraging`` makes its averaged copy in ``setup()``, which runs before Lightning calls the
module's ``configure_model``; so for a module that overrides it (every task here: ``tasks/base.py`` builds the
model there, once the data has given its sizes) it calls ``configure_model`` itself, which is what makes the copy
complete, and warns: "WeightAveraging doesn't support sharding model layers, so you may run out of memory". On one
device and under DDP nothing is sharded, every process holds the whole model anyway, and the warning is dropped;
under any other strategy (FSDP, DeepSpeed, model parallel) it stays.
"""

from __future__ import annotations

import warnings

from lightning.pytorch.callbacks import EMAWeightAveraging
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

#: the strategies under which every process builds and holds the whole model (no layer is sharded)
UNSHARDED = (SingleDeviceStrategy, DDPStrategy)
#: the start of Lightning's warning
SHARDING_WARNING = "You're using the WeightAveraging callback with a model that overrides the configure_model"


class EMA(EMAWeightAveraging):
    """Lightning's ``EMAWeightAveraging`` (same arguments; its checkpoint state under the same key, so either
    class resumes the other's runs); see the module docstring."""

    @property
    def state_key(self) -> str:
        return EMAWeightAveraging.__qualname__

    def setup(self, trainer, pl_module, stage: str) -> None:
        with warnings.catch_warnings():
            if type(trainer.strategy) in UNSHARDED:
                warnings.filterwarnings("ignore", message=SHARDING_WARNING)
            super().setup(trainer, pl_module, stage)
