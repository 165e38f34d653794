"""Sharded checkpoints: a folder written by every rank, read without running pickled code, and consolidated.

The folder (``last.ckpt/``, ``hpc_ckpt_3.ckpt/``) is what Lightning's ``ModelParallelStrategy`` writes: PyTorch
distributed checkpoint (DCP) files, one ``__<rank>_0.distcp`` per rank plus DCP's ``.metadata`` (weights and
optimizer states, each rank its shards), and ``meta.pt`` (everything else of the Lightning checkpoint: loops, lr
schedulers, callbacks' states with every rank's RNG state, hyperparameters). Three things differ from Lightning's:

* **Safe reading.** Lightning reads ``meta.pt`` with a bare ``torch.load`` and DCP unpickles ``.metadata`` and every
  non-tensor value with ``pickle``/``weights_only=False``: a folder from the internet could run code. Here
  ``meta.pt`` goes through the project's loader (:func:`~polyattn_lightning.checkpoint.load_checkpoint`,
  ``weights_only``), ``.metadata`` through an unpickler that builds only DCP's own metadata classes, torch sizes and
  dtypes, and non-tensor values through ``torch.load(weights_only=True)``.
* **Atomic writing.** Every rank writes into a hidden temporary folder beside the target; when all are done, rank 0
  puts it in place with renames, so a crash or a preemption mid-write leaves the previous checkpoint whole (an
  ``hpc_ckpt`` a requeued job finds is never torn).
* **Consolidation.** :func:`read_consolidated` turns the folder into the one-file Lightning checkpoint that the DDP
  path writes (full weights; optimizer states keyed by parameter index), with no process group: it resumes on one
  process, on DDP, or on this strategy with any number of ranks.

Optimizer states in DCP are keyed by parameter name; :func:`by_name` and :func:`by_index` convert between those and
``torch.optim``'s own index-keyed ``state_dict``.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner

from ..checkpoint import CheckpointLoadError, atomic_save, load_checkpoint

#: Lightning's name for the non-tensor part of a sharded checkpoint (``lightning.fabric.utilities.load``).
META_FILE = "meta.pt"
#: DCP's index of a checkpoint folder; written last by DCP, so its presence means the tensors are complete.
DCP_METADATA = ".metadata"
#: The ``meta.pt`` key naming the LightningModule class that wrote it (what ``consolidate --pretrained`` rebuilds).
TASK_KEY = "task_class"


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a sharded checkpoint folder: DCP's ``.metadata`` and Lightning's ``meta.pt`` in it."""
    path = Path(path)
    return path.is_dir() and (path / DCP_METADATA).is_file() and (path / META_FILE).is_file()


def check_sharded_folder(path: str | os.PathLike) -> Path:
    """``path`` as a sharded checkpoint folder, or a :class:`CheckpointLoadError` saying which file it lacks."""
    path = Path(path)
    missing = [name for name in (DCP_METADATA, META_FILE) if not (path / name).is_file()]
    if missing:
        raise CheckpointLoadError(
            f"checkpoint folder {path} is not a sharded checkpoint: it has no {' and no '.join(missing)} "
            "(a sharded checkpoint folder holds DCP's .metadata, one .distcp file per rank and meta.pt)"
        )
    return path


# ---- reading without pickled code ----------------------------------------------------------------------------

#: The classes a DCP ``.metadata`` file holds (torch 2.4-2.14), by module.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint._extension": {"StreamTransformExtension"},
    "torch": {
        "Size",
        "device",
        "layout",
        "float32",
        "float64",
        "float16",
        "bfloat16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
        "complex64",
        "complex128",
        "strided",
        "sparse_coo",
        "float8_e4m3fn",
        "float8_e5m2",
    },
    "torch.serialization": {"_get_layout"},
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a class a DCP .metadata file holds")


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, its ``.metadata`` unpickled into DCP's own classes only (nothing else is built)."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            data = stream.read()
        try:
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as err:
            raise CheckpointLoadError(f"checkpoint {self.path}: {DCP_METADATA} cannot be read safely ({err})") from err
        self._init_storage_meta(metadata)
        return metadata

    def _init_storage_meta(self, metadata) -> None:
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id


def _weights_only_load_bytes(planner: DefaultLoadPlanner, read_item: Any, value: io.BytesIO) -> None:
    """DefaultLoadPlanner.load_bytes with ``torch.load(weights_only=True)`` in place of ``weights_only=False``."""
    from torch.distributed.checkpoint._nested_dict import set_element

    loaded = torch.load(value, weights_only=True)
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[read_item.dest_index.fqn], loaded)
    else:
        planner.state_dict[read_item.dest_index.fqn] = loaded


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, its non-tensor values (optimizer hyperparameters) read with ``weights_only``."""

    load_bytes = _weights_only_load_bytes


class SafeEmptyLoadPlanner(_EmptyStateDictLoadPlanner):
    """DCP's planner for reading a whole checkpoint into an empty dict (``dcp_to_torch_save``'s), made as safe."""

    load_bytes = _weights_only_load_bytes


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """A sharded folder's ``meta.pt`` (the Lightning checkpoint without weights and optimizer states), loaded safely."""
    return load_checkpoint(check_sharded_folder(path) / META_FILE)


def dcp_load(state: dict[str, Any], path: str | os.PathLike) -> None:
    """Fill ``state`` (DTensor shards or full tensors, in place) from the folder, through the safe reader."""
    import torch.distributed.checkpoint as dcp

    dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())


def read_consolidated(path: str | os.PathLike) -> dict[str, Any]:
    """The folder as the one-file Lightning checkpoint the DDP path writes, with no process group: ``meta.pt``'s
    entries, the full ``state_dict`` and ``optimizer_states`` keyed by parameter index (:func:`by_index`)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    checkpoint = read_meta(path)
    tensors: dict[str, Any] = {}  # filled in place, as torch's own dcp_to_torch_save does
    _load_state_dict(tensors, storage_reader=SafeFileSystemReader(path), planner=SafeEmptyLoadPlanner(), no_dist=True)
    checkpoint.pop(TASK_KEY, None)
    checkpoint["state_dict"] = tensors.pop("state_dict")
    optimizers = sorted((key for key in tensors if key.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    checkpoint["optimizer_states"] = [by_index(tensors[key]) for key in optimizers]
    return checkpoint


def in_memory_file(checkpoint: dict[str, Any]) -> io.BytesIO:
    """``checkpoint`` as a file in memory, for what reads only files (``LightningModule.load_from_checkpoint``)."""
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    return buffer


# ---- optimizer states: by parameter name (DCP) and by index (torch.optim) -----------------------------------


def by_index(state: dict[str, Any]) -> dict[str, Any]:
    """A name-keyed optimizer state (``get_optimizer_state_dict``'s) keyed by index, as ``Optimizer.state_dict()``:
    the parameters numbered in the order the param groups list them."""
    order = [name for group in state["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(order)}
    return {
        "state": {index[name]: value for name, value in state["state"].items()},
        "param_groups": [{**group, "params": [index[n] for n in group["params"]]} for group in state["param_groups"]],
    }


def by_name(state: dict[str, Any], module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An index-keyed optimizer state of ``optimizer`` keyed by the names of its parameters in ``module``."""
    if not state.get("param_groups") or not isinstance(state["param_groups"][0]["params"][0], int):
        return state  # already by name
    names = {id(p): name for name, p in module.named_parameters(remove_duplicate=False)}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    return {
        "state": {order[i]: value for i, value in state["state"].items()},
        "param_groups": [{**group, "params": [order[i] for i in group["params"]]} for group in state["param_groups"]],
    }


# ---- writing -------------------------------------------------------------------------------------------------


def write_sharded(checkpoint: dict[str, Any], path: str | os.PathLike, rank: int, barrier: Any, broadcast: Any) -> None:
    """Every rank: write ``checkpoint`` (its ``state_dict`` and ``optimizer_states`` sharded) as the folder ``path``,
    atomically (module docstring). ``barrier()`` and ``broadcast(obj)`` are the strategy's collectives."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    # no part of the target's name: Lightning finds the newest hpc_ckpt_<n> by the digits of any name holding it
    tmp = path.with_name(f".{broadcast(uuid.uuid4().hex[:8])}.writing")
    tensors = {"state_dict": checkpoint.pop("state_dict")}
    tensors.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    dcp.save(tensors, storage_writer=FileSystemWriter(tmp, sync_files=True))
    if rank == 0:
        atomic_save(checkpoint, tmp / META_FILE)
    barrier()
    if rank == 0:
        replace_folder(tmp, path)
    barrier()


def replace_folder(new: Path, path: Path) -> None:
    """Put the complete folder ``new`` at ``path`` (a file or folder there is replaced) with renames, then fsync."""
    old = path.with_name(f".{uuid.uuid4().hex[:8]}.replaced") if path.exists() else None
    if old is not None:
        os.replace(path, old)
    os.replace(new, path)
    if old is not None:
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s state dict with whole tensors on CPU (sharded parameters gathered: every rank must call it;
    ranks but 0 get an empty dict), or its plain ``state_dict()`` when nothing in it is sharded.

    As in ``state_dict()``, the names of one shared parameter (tied weights: an LM head and its input embeddings)
    hold one tensor: gathering copies each name on its own, and ``save_pretrained``, which finds tied weights by
    their storage, would then write the head as a weight of its own."""
    from torch.distributed.tensor import DTensor

    if not any(isinstance(p, DTensor) for p in module.parameters()):
        return module.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    names: dict[int, list[str]] = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    for shared in names.values():
        held = [name for name in shared if name in state]
        for name in held[1:]:
            state[name] = state[held[0]]
    return state


def load_full(
    checkpoint: dict[str, Any], module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], strict: bool
) -> None:
    """Load a one-file checkpoint's full weights and optimizer states into the sharded ``module`` (each rank keeps
    its shards); removes them from ``checkpoint``."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, strict=strict)
    set_model_state_dict(module, checkpoint.pop("state_dict"), options=options)
    states = checkpoint.pop("optimizer_states", [])
    for optimizer, state in zip(optimizers, states):
        set_optimizer_state_dict(module, optimizer, optim_state_dict=by_name(state, module, optimizer), options=options)


def load_sharded(
    path: str | os.PathLike, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], strict: bool
) -> dict[str, Any]:
    """Every rank: load the folder's weights and optimizer states into the sharded ``module`` and ``optimizers``
    (DCP reshards: the folder may come from another number of ranks); returns ``meta.pt``'s entries."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    meta = read_meta(path)
    state = {"state_dict": get_model_state_dict(module)}
    dcp_load(state, path)
    module.load_state_dict(state["state_dict"], strict=strict)
    for i, optimizer in enumerate(optimizers):
        key = f"optimizer_{i}"
        state = {key: get_optimizer_state_dict(module, optimizer)}
        dcp_load(state, path)
        set_optimizer_state_dict(module, optimizer, optim_state_dict=state[key], options=StateDictOptions())
    meta.pop(TASK_KEY, None)
    return meta
