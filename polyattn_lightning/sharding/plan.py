"""Which modules FSDP2 shards as units, and the ``fully_shard`` calls that do it.

A unit is all-gathered before its forward and freed after it, so the unit sizes what one rank holds in full at a
time: one transformer block (a 1.1B Llama's decoder layer is 44M parameters, 2% of the model). The blocks are
what each library names as its unit of a model:

* Hugging Face: the classes in ``_no_split_modules`` of every ``PreTrainedModel`` in the model (``LlamaDecoderLayer``,
  ``BertLayer``, ``ViTLayer``; a composite model lists its towers' classes), the same list ``device_map`` and
  HF's own FSDP integration use.
* timm and this project's models: the items of every ``ModuleList``/``Sequential`` named ``blocks`` or ending in
  ``_blocks`` (ViT, DeiT, EVA, BEiT: ``blocks``; Swin: ``layers.N.blocks``; XCiT and CaiT: ``blocks`` and
  ``cls_attn_blocks``/``blocks_token_only``; the LRA encoder: ``blocks``).

A block inside another block is not a unit of its own. After the blocks the root (the task's optimized module) is
sharded: it holds what is left (embeddings, final norm, head), and every trainable parameter must be under it, since
no other module reduces gradients across ranks under this strategy.

Activation checkpointing, when asked for, is per block and non-reentrant (torch's composable ``checkpoint``: hooks,
no wrapper module, so parameter names and the attention modules' paths stay the model's): a block keeps only its
input for the backward and recomputes the rest, with the RNG state of its forward (dropout draws the same numbers).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from ..errors import ConfigError


class NoShardableBlock(ConfigError):
    """A model in which the sharding plan finds no block: sharding it whole would gather all of it at once."""


def hf_block_classes(model: nn.Module) -> set[str]:
    """The class names in ``_no_split_modules`` of every Hugging Face ``PreTrainedModel`` inside ``model``."""
    names: set[str] = set()
    for module in model.modules():
        listed = getattr(type(module), "_no_split_modules", None) or getattr(module, "_no_split_modules", None)
        if listed and hasattr(module, "config"):
            names.update(listed)
    return names


def _block_lists(model: nn.Module) -> Iterable[nn.Module]:
    for name, module in model.named_modules():
        leaf = name.rpartition(".")[2]
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and (leaf == "blocks" or leaf.endswith("_blocks")):
            yield from module.children()


def shardable_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of ``model`` (module docstring), outermost only, in model order; an empty list when it has none."""
    hf_names = hf_block_classes(model)
    candidates = {id(module) for module in _block_lists(model)}
    candidates |= {id(module) for module in model.modules() if type(module).__name__ in hf_names}
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():  # pre-order: a block is met before the modules inside it
        if id(module) in inside:
            continue
        if id(module) in candidates and module is not model:
            blocks.append(module)
            inside.update(id(sub) for sub in module.modules())
    return blocks


def require_blocks(model: nn.Module) -> list[nn.Module]:
    """:func:`shardable_blocks`, or a one-line :class:`NoShardableBlock` naming the model and what was looked for."""
    blocks = shardable_blocks(model)
    if not blocks:
        raise NoShardableBlock(
            f"{type(model).__name__} has no block to shard: no module of a class in _no_split_modules "
            "(Hugging Face) and no `blocks` list (timm); FSDP2 would gather the whole model at once. "
            "Train it with DDP (configs/strategy/ddp.yaml) or give it a `blocks` ModuleList"
        )
    return blocks


def check_all_trained_under(task: nn.Module, root: nn.Module) -> None:
    """Every trainable parameter of ``task`` is inside ``root`` (the sharded module); else a one-line error."""
    inside = {id(p) for p in root.parameters()}
    outside = [name for name, p in task.named_parameters() if p.requires_grad and id(p) not in inside]
    if outside:
        raise ConfigError(
            f"{type(task).__name__}: trainable parameters outside its optimized module ({', '.join(outside[:3])}"
            f"{'...' if len(outside) > 3 else ''}) would not be reduced across ranks under the sharded strategy; "
            "move them into the module optimized_module() returns"
        )


def apply_plan(
    root: nn.Module,
    blocks: list[nn.Module],
    mesh: Any,
    mp_policy: Any,
    reshard_after_forward: bool = True,
    activation_checkpointing: bool = False,
) -> None:
    """``fully_shard`` each block (after its activation checkpointing), then ``root``, over the data-parallel ``mesh``
    with the mixed-precision policy ``mp_policy``; the root keeps its parameters gathered from forward to backward
    (FSDP2's default for a root: it is needed first in backward)."""
    from torch.distributed._composable import checkpoint
    from torch.distributed.fsdp import fully_shard

    for block in blocks:
        if activation_checkpointing:
            checkpoint(block)
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    fully_shard(root, mesh=mesh, mp_policy=mp_policy)


def plain_class(module: nn.Module) -> type:
    """``module``'s own class: ``fully_shard`` swaps it for a subclass (``FSDPLlamaForCausalLM``) that names it."""
    from torch.distributed.fsdp import FSDPModule

    return next(cls for cls in type(module).__mro__ if not issubclass(cls, FSDPModule))
