"""Random number generator states in checkpoints, per rank, so a resumed run draws what the original drew."""
from __future__ import annotations

import random
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

#: The checkpoint key: a list of state dicts indexed by global rank.
CHECKPOINT_KEY = "rng_states"


def capture_rng_state() -> dict[str, Any]:
    """This process's torch (CPU and current CUDA device), numpy and python RNG states, as weights_only-loadable values."""
    kind, key, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": (kind, key.tolist(), pos, has_gauss, gauss),  # a list, not an ndarray: weights_only refuses arrays
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`."""
    torch.set_rng_state(state["torch"])
    kind, key, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(key, dtype=np.uint32), pos, has_gauss, gauss))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class RNGStateCheckpoint(Callback):
    """Saves every rank's RNG states in each checkpoint and restores them when a resumed fit starts.

    Lightning's checkpoints hold no RNG state, so after a resume dropout, drop
    path, Mixup/CutMix and in-process augmentations draw differently from an
    uninterrupted run. The states are restored in ``on_train_start``: after the
    sanity check, right before the first batch is drawn, which is where the
    original run stood when it saved. Resuming on another number of ranks
    restores nothing (with a warning).
    """

    def __init__(self) -> None:
        self._pending: list[dict[str, Any]] | None = None

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        state = capture_rng_state()
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            states: list[Any] = [None] * trainer.world_size
            dist.all_gather_object(states, state)  # every rank saves; only rank 0 writes the file
        else:
            states = [state]
        checkpoint[CHECKPOINT_KEY] = states

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        self._pending = checkpoint.get(CHECKPOINT_KEY)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        states, self._pending = self._pending, None
        if states is None:
            return
        if len(states) != trainer.world_size:
            rank_zero_warn(
                f"the checkpoint holds RNG states for {len(states)} ranks but this run has {trainer.world_size}:"
                " random draws will differ from the original run"
            )
            return
        restore_rng_state(states[trainer.global_rank])
