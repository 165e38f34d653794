"""Per-rank memory said out loud: an estimate before training for DDP and for sharding, then what a rank holds.

The estimate has four parts, each per rank:

* **parameters**, **gradients**: the model's bytes in its parameter dtype (DDP: all of it on every rank; sharded:
  ``1 / data-parallel size`` of it, FSDP2's dim-0 shards padded to a multiple of the ranks), plus, when sharded, the
  largest block gathered whole for its forward and backward (one block at a time; a second with prefetching);
  with a ``param_dtype`` policy the gathered copy is in that dtype.
* **optimizer**: states per parameter element, in the parameters' dtype (fp32 master shards under a ``param_dtype``
  policy), by the optimizer's class (AdamW, Adam: 2; SGD with momentum, RMSprop, Adagrad: 1; plain SGD: 0; others:
  not estimated, measured after the first step).
* **activations**: what autograd saves for the backward of one sample, measured by one forward of one sample
  (``saved_tensors_hooks`` count the bytes; the output, which the loss reads, counts once), times the per-rank
  batch. Activation checkpointing is in that number: a checkpointed block saves only its input.

After the first steps :func:`held_bytes` measures what a rank holds: the storage of its parameters (their local
shards), gradients and optimizer states, each storage counted once; and the process's peak (CUDA: the caching
allocator's peak; CPU: the peak resident set, which also counts the Python process and libraries).
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

GIB = 2**30


def human(size: float) -> str:
    """Bytes in the largest binary unit that keeps the number at or above 1: ``1.23 GiB``, ``45.6 MiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(size) >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size:.0f} B"


#: Optimizer state tensors per parameter element, by optimizer class name.
STATES_PER_ELEMENT = {"AdamW": 2, "Adam": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "RMSprop": 1, "Adagrad": 1}


def states_per_element(optimizer: torch.optim.Optimizer | None) -> int | None:
    """How many tensors the optimizer keeps per parameter element (None: not known for its class)."""
    if optimizer is None:
        return None
    name = type(optimizer).__name__
    if name == "SGD":
        return int(any(group.get("momentum", 0) for group in optimizer.param_groups))
    return STATES_PER_ELEMENT.get(name)


@dataclass(frozen=True)
class MemoryEstimate:
    """One layout's per-rank bytes."""

    layout: str
    parameters: float
    gradients: float
    optimizer: float | None
    activations: float
    gathered: float = 0.0

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + (self.optimizer or 0.0) + self.activations + self.gathered

    def line(self) -> str:
        optimizer = "?" if self.optimizer is None else human(self.optimizer)
        gathered = f" + gathered block {human(self.gathered)}" if self.gathered else ""
        return (
            f"{self.layout} {human(self.total)} = parameters {human(self.parameters)} + gradients "
            f"{human(self.gradients)} + optimizer {optimizer} + activations {human(self.activations)}{gathered}"
        )


def _element_bytes(module: nn.Module, elements: Callable[[Tensor], int]) -> tuple[int, int]:
    """(bytes of the trainable parameters, of all parameters) of ``module``, each tensor counted once."""
    seen, trainable, total = set(), 0, 0
    for p in module.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        size = elements(p) * p.element_size()
        total += size
        trainable += size if p.requires_grad else 0
    return trainable, total


def estimate(
    module: nn.Module,
    blocks: Iterable[nn.Module],
    world: int,
    states: int | None,
    activations: float,
    gathered_dtype: torch.dtype | None = None,
) -> tuple[MemoryEstimate, MemoryEstimate]:
    """(DDP, FSDP2 over ``world`` ranks) per-rank estimates for ``module`` (its whole sizes, whether or not it is
    sharded now); ``states`` per element (:func:`states_per_element`), ``activations`` in bytes per rank."""

    def whole(p: Tensor) -> int:
        return p.numel()  # a DTensor's numel is its global size

    def shard(p: Tensor) -> int:
        rows = p.shape[0] if p.dim() else 1
        return -(-rows // world) * (p.numel() // max(rows, 1))  # FSDP2 pads dim 0 to a multiple of the ranks

    trainable, total = _element_bytes(module, whole)
    trainable_shard, total_shard = _element_bytes(module, shard)
    ddp = MemoryEstimate("DDP", total, trainable, None if states is None else states * trainable, activations)
    gathered = max((_element_bytes(block, whole)[1] for block in blocks), default=0)
    if gathered_dtype is not None:
        element = next((p.element_size() for p in module.parameters()), 4)
        gathered = gathered * torch.empty((), dtype=gathered_dtype).element_size() / element
    sharded = MemoryEstimate(
        f"FSDP2 over {world} rank{'s' if world > 1 else ''}",
        total_shard,
        trainable_shard,
        None if states is None else states * trainable_shard,
        activations,
        2 * gathered if world > 1 else 0,  # its parameters and gradients while one block runs its backward
    )
    return ddp, sharded


def saved_bytes_of(forward: Callable[[], object]) -> int:
    """Bytes autograd saves for the backward of ``forward()`` (grad enabled), each storage once, plus its output."""
    seen: dict[int, int] = {}

    def pack(tensor: Tensor) -> Tensor:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = forward()
    outputs = [output] if isinstance(output, Tensor) else [t for t in getattr(output, "values", list)() or []]
    for tensor in (t for t in outputs if isinstance(t, Tensor)):
        seen.setdefault(tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
    return sum(seen.values())


def _storages(tensors: Iterable[Tensor]) -> int:
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def held_bytes(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> dict[str, int]:
    """What this rank holds now: ``parameters``, ``gradients`` and ``optimizer`` (state tensors) in bytes."""
    params = list(module.parameters())
    states = [
        value
        for optimizer in optimizers
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, Tensor) and value.dim() > 0
    ]
    return {
        "parameters": _storages(params),
        "gradients": _storages(p.grad for p in params if p.grad is not None),
        "optimizer": _storages(states),
    }


def peak_bytes(device: torch.device) -> int:
    """This process's peak memory so far: CUDA's allocator peak on a GPU, else the peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB
