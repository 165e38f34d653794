"""``ShardedStrategy``: Lightning's ``ModelParallelStrategy`` as FSDP2 over every rank, with the project's plan.

Lightning's own defaults are ``data_parallel_size = num_nodes`` and ``tensor_parallel_size = devices``: on one node
with 2 devices that is 1 x 2, so ``fully_shard`` over a size-1 mesh shards nothing and both ranks train on the same
batches, silently. Here data-parallel is the world size and tensor-parallel 1 (q/k/v as head-sharded DTensors would
need the attention kernels to take them; a tensor-parallel size other than 1 is refused).

The task's ``configure_model()`` calls :meth:`ShardedStrategy.shard` (``tasks/base.py``): per block, activation
checkpointing when asked for and ``fully_shard``; then the root (:mod:`.plan`). A model built from a config inside
:meth:`ShardedStrategy.init_context` is on the meta device and is given storage and its own init only once sharded
(:mod:`.init`): no rank ever holds it whole.

Precision: ``precision: 32-true`` with ``param_dtype: bfloat16`` is FSDP2's ``MixedPrecisionPolicy``: fp32 master
shards, which the optimizer updates; bf16 copies gathered for forward and backward; gradients reduced in
``reduce_dtype`` (fp32). ``param_dtype: auto`` (the default) is bfloat16 on a GPU that has it and no policy on CPU.
``precision: bf16-true`` is the low-memory variant: bf16 parameters, gradients and optimizer states, no master
weights (6 bytes per parameter with AdamW instead of 16, and the updates lose the low bits). ``bf16-mixed`` (autocast)
runs on fp32 parameters and takes no ``param_dtype``.

Checkpoints are folders (:mod:`.checkpoints`): written atomically, read without running pickled code, and loaded
on any number of ranks (DCP reshards); a one-file checkpoint (DDP's, or a consolidated one) loads too.
"""

from __future__ import annotations

import contextlib
import contextvars
import shutil
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from ..checkpoint import load_checkpoint as load_checkpoint_file
from ..errors import ConfigError
from . import checkpoints
from .init import hf_initializer, materialize, on_meta
from .plan import apply_plan, check_all_trained_under, require_blocks

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class ShardedStrategy(ModelParallelStrategy):
    """FSDP2 over all ranks through Lightning (module docstring); the task shards its model in ``configure_model``.

    Args:
        param_dtype: the dtype blocks are gathered and computed in (``bfloat16``, ``float16``, ``float32``), the
            fp32 parameters staying the master copy; ``auto``: bfloat16 on a GPU that supports it, else none;
            None: no policy (compute in the parameters' dtype).
        reduce_dtype: the dtype gradients are reduced in when ``param_dtype`` is set.
        activation_checkpointing: recompute each block's activations in the backward (non-reentrant), keeping only
            its input: activation memory about one block's worth plus one tensor per block.
        reshard_after_forward: free each block's gathered parameters after its forward and gather them again for
            the backward (False keeps them: more memory, one all-gather less per block and step).
        meta_init: build models that come from a config (random init) on the meta device and initialise them after
            sharding; False builds them whole in every rank's host memory first.
        save_distributed_checkpoint: checkpoints as folders of shards (False: one file gathered on rank 0).
        data_parallel_size: ranks the parameters are sharded over; ``auto`` is all of them.
        tensor_parallel_size: must be 1.
        process_group_backend, timeout: as for Lightning's strategies (gloo on CPU, nccl on GPU).
    """

    def __init__(
        self,
        param_dtype: Literal["auto", "bfloat16", "float16", "float32"] | None = "auto",
        reduce_dtype: Literal["bfloat16", "float16", "float32"] = "float32",
        activation_checkpointing: bool = False,
        reshard_after_forward: bool = True,
        meta_init: bool = True,
        save_distributed_checkpoint: bool = True,
        data_parallel_size: int | Literal["auto"] = "auto",
        tensor_parallel_size: int = 1,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        if tensor_parallel_size != 1:
            raise ConfigError(
                f"ShardedStrategy: tensor_parallel_size {tensor_parallel_size} is not supported (the attention "
                "kernels take whole heads, not head-sharded DTensors); leave it at 1"
            )
        for key, value in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if value not in (*DTYPES, "auto", None) or (key == "reduce_dtype" and value in ("auto", None)):
                raise ConfigError(f"ShardedStrategy: {key} {value!r} is not one of {', '.join(DTYPES)}")
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.activation_checkpointing = activation_checkpointing
        self.reshard_after_forward = reshard_after_forward
        self.meta_init = meta_init
        #: what :meth:`shard` found and did: the blocks (FSDP2 units), and whether the model came from the meta device
        self.blocks: list[nn.Module] = []
        self.built_on_meta = False

    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes
        if self._data_parallel_size != self.num_nodes * self.num_processes:
            raise ConfigError(
                f"ShardedStrategy: data_parallel_size {self._data_parallel_size} is not the number of ranks "
                f"({self.num_nodes * self.num_processes}); leave it at auto"
            )
        super().setup_environment()

    # ---- the plan ------------------------------------------------------------------------------------------

    def compute_dtype(self) -> torch.dtype | None:
        """The ``param_dtype`` in effect (``auto`` resolved; None: no mixed-precision policy)."""
        mixed = isinstance(self.precision_plugin, MixedPrecision)
        if self.param_dtype == "auto":
            gpu = self.root_device.type == "cuda" and torch.cuda.is_bf16_supported()
            return torch.bfloat16 if gpu and not mixed else None
        if self.param_dtype is not None and mixed:
            raise ConfigError(
                f"ShardedStrategy: param_dtype {self.param_dtype} and precision {self.precision_plugin.precision} "
                "both cast the computation; give one: precision 32-true with param_dtype bfloat16 (fp32 master "
                "shards), or bf16-mixed with param_dtype null"
            )
        return None if self.param_dtype is None else DTYPES[self.param_dtype]

    def init_context(self) -> contextlib.AbstractContextManager:
        """Where a task builds a model from a config: the meta device (``meta_init``), else where it would anyway."""
        return torch.device("meta") if self.meta_init else contextlib.nullcontext()

    def shard(self, task: nn.Module, root: nn.Module) -> None:
        """Shard ``root`` (the task's optimized module) by the plan; give a meta-device model storage and its own
        init. Once: a root already sharded is left as it is."""
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

        if isinstance(root, FSDPModule):
            return
        blocks = require_blocks(root)
        check_all_trained_under(task, root)
        dtype = self.compute_dtype()
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=DTYPES[self.reduce_dtype] if dtype else None)
        meta = on_meta(root)
        init = hf_initializer(root) if meta else None
        if meta and init is None:
            raise ConfigError(f"{type(root).__name__} was built on the meta device but has no per-module init")
        apply_plan(
            root,
            blocks,
            self.device_mesh["data_parallel"],
            policy,
            self.reshard_after_forward,
            self.activation_checkpointing,
        )
        if meta:
            materialize(root, self.root_device, init)
        self.blocks, self.built_on_meta = blocks, meta

    # ---- checkpoints ---------------------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        """A folder of shards, written atomically (:func:`~.checkpoints.write_sharded`); or, without
        ``save_distributed_checkpoint``, Lightning's one file through the trainer's checkpoint IO."""
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError("ShardedStrategy.save_checkpoint takes no storage_options (it writes folders itself)")
        path = Path(self.broadcast(str(filepath)))
        if self.lightning_module is not None:
            cls = type(self.lightning_module)
            checkpoint[checkpoints.TASK_KEY] = f"{cls.__module__}.{cls.__qualname__}"
        checkpoints.write_sharded(checkpoint, path, self.global_rank, self.barrier, self.broadcast)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """A sharded folder or a one-file checkpoint, read the safe way (``weights_only`` unless it is False)."""
        path = Path(self.broadcast(str(checkpoint_path)))
        strict = self.lightning_module.strict_loading if self.lightning_module is not None else True
        if path.is_dir():
            return checkpoints.load_sharded(checkpoints.check_sharded_folder(path), self.model, self.optimizers, strict)
        checkpoint = load_checkpoint_file(path, weights_only=weights_only is not False)
        checkpoints.load_full(checkpoint, self.model, self.optimizers, strict)
        return checkpoint

    def remove_checkpoint(self, filepath) -> None:
        """Remove a checkpoint folder (or file) on rank 0."""
        if self.is_global_zero:
            path = Path(filepath)
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)


def sharded_strategy(module: Any) -> ShardedStrategy | None:
    """The :class:`ShardedStrategy` that ``module``'s trainer runs (a LightningModule or a Trainer), or None."""
    trainer = getattr(module, "_trainer", None) if not hasattr(module, "strategy") else module
    strategy = getattr(trainer, "strategy", None) if trainer is not None else None
    return strategy if isinstance(strategy, ShardedStrategy) else None


_BUILD_LATER = contextvars.ContextVar("polyattn_build_later", default=False)


@contextlib.contextmanager
def build_later() -> Iterator[None]:
    """Tasks made inside do not build their model in ``__init__`` (they do in ``configure_model``, under the
    strategy): the CLI makes the model inside it when the trainer's strategy is sharded, so that a model from a
    config is built on the meta device, never whole in every rank's host memory first."""
    token = _BUILD_LATER.set(True)
    try:
        yield
    finally:
        _BUILD_LATER.reset(token)


def building_later() -> bool:
    """Whether a task made now leaves building its model to ``configure_model`` (:func:`build_later`)."""
    return _BUILD_LATER.get()
