"""Models bigger than one GPU: FSDP2 through Lightning, one block per unit, sharded checkpoints, memory said out loud.

* :mod:`.strategy`: :class:`ShardedStrategy`, Lightning's ``ModelParallelStrategy`` as FSDP2 over every rank
  (``configs/<family>/trainer/fsdp.yaml`` turn it on with ``--trainer``).
* :mod:`.plan`: the blocks each library names (HF ``_no_split_modules``, timm ``blocks``), activation checkpointing
  per block and the ``fully_shard`` calls.
* :mod:`.init`: a model built on the meta device, sharded, then given its own init module by module.
* :mod:`.checkpoints`: checkpoint folders written atomically, read without pickled code, consolidated to one file.
* :mod:`.memory`: the per-rank estimate for DDP and for sharding, and what a rank holds once training.

Tasks call the strategy from ``configure_model`` (``tasks/base.py``); nothing here imports a task.
"""

from .checkpoints import full_state_dict, is_sharded_checkpoint, read_consolidated
from .plan import NoShardableBlock, plain_class, shardable_blocks
from .strategy import ShardedStrategy, build_later, building_later, sharded_strategy

__all__ = [
    "NoShardableBlock",
    "ShardedStrategy",
    "build_later",
    "building_later",
    "full_state_dict",
    "is_sharded_checkpoint",
    "plain_class",
    "read_consolidated",
    "shardable_blocks",
    "sharded_strategy",
]
